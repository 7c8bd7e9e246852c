"""Continuous batching: a ``Scheduler`` admits and retires requests at every decode step.

Each ``step``: arrivals join the queue; free slots are refilled from it (a new request's prompt is
prefilled in the step, beside the running requests' one-token decodes); on a paged cache, a sequence
whose next token finds no free block preempts the newest other sequence, which is requeued and
later recomputed; one forward pass; every request samples with its own generator, and those done
retire. ``policy="static"`` is static batching with the same code (the same tokens, more steps).
``prefix_cache=True`` serves over a ``PrefixCachingKVCache``: only a prompt's uncached tail is
prefilled. Chapter 9 (lessons/09-inference.md) has the why and the measurements.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from minidist.autograd.tensor import no_grad
from minidist.infer.decoder import as_decoder, forward_tokens, last_logits
from minidist.infer.generate import check_ids, check_prompt, host, is_done, stop_set
from minidist.infer.kv_cache import KVCache
from minidist.infer.paged import OutOfBlocks, PagedKVCache
from minidist.infer.prefix_cache import PrefixCachingKVCache
from minidist.infer.sampling import GREEDY, SamplingParams, is_int, sample
from minidist.trace.spans import now


@dataclass
class Request:
    id: int
    prompt: list
    max_new_tokens: int
    sampling: SamplingParams = GREEDY
    stop_tokens: tuple = ()
    arrival: int = 0  # the step at which it joins the queue
    # filled in while it runs
    out: list = field(default_factory=list)
    admitted: int | None = None
    finished: int | None = None
    preemptions: int = 0
    arrived_s: float | None = None  # the rank's clock (trace.clock.now) when it joined the queue
    ttft_s: float | None = None  # seconds from joining the queue to its first token

    def __post_init__(self):
        self.stop_tokens = tuple(sorted(stop_set(self.stop_tokens)))

    @property
    def done(self) -> bool:
        return self.max_new_tokens == 0 or is_done(self.out, self.max_new_tokens, set(self.stop_tokens))


class Scheduler:
    """Serve requests with ``max_batch`` slots on a contiguous or paged KV cache.

    ``cache``: "contiguous" (the default), "paged", or a cache object with at least ``max_batch``
    slots (any of ``KVCache``, ``PagedKVCache``, their int8 forms, a ``PrefixCachingKVCache``);
    ``prefix_cache=True``: a paged ``PrefixCachingKVCache`` of ``num_blocks`` blocks."""

    def __init__(self, model, max_batch=8, policy="continuous", cache=None, num_blocks=None,
                 block_len=16, prefix_cache=False):
        for name, v in (("max_batch", max_batch), ("block_len", block_len), ("num_blocks", num_blocks)):
            if not (v is None and name == "num_blocks" or is_int(v) and v >= 1):
                raise ValueError(f"Scheduler: {name} must be an integer >= 1, got {v!r}")
        if policy not in ("continuous", "static"):
            raise ValueError(f"policy must be 'continuous' or 'static', got {policy!r}")
        if not isinstance(prefix_cache, bool):
            raise ValueError(f"Scheduler: prefix_cache must be True or False, got {prefix_cache!r}")
        self.w = as_decoder(model)
        self.policy, self.max_batch = policy, max_batch
        self.cache = self._make_cache(cache, prefix_cache, num_blocks, block_len)
        self.sharing = isinstance(self.cache, PrefixCachingKVCache)
        self.hits = {}  # slot -> prompt tokens its admission found cached (not fed)
        self.pending, self.waiting = [], deque()
        self.running = {}  # slot -> Request, in admission order
        self.rngs, self.done = {}, []
        self.t = 0
        self.history = []  # per step: {slot: request id} of the rows that ran (for timelines)
        self.stats = {"steps": 0, "tokens": 0, "preemptions": 0, "forward_rows": 0,
                      "peak_reserved": 0, "peak_used": 0, "looked_up_tokens": 0, "hit_tokens": 0}

    def _make_cache(self, cache, prefix_cache, num_blocks, block_len):
        if cache is None:
            cache = "paged" if prefix_cache else "contiguous"
        if isinstance(cache, str):
            if cache == "contiguous" and prefix_cache:
                raise ValueError("Scheduler: prefix_cache=True shares paged blocks; pass cache='paged' "
                                 "(or leave cache unset), not 'contiguous'")
            if cache == "contiguous":
                return KVCache.for_decoder(self.w, self.max_batch)
            if cache != "paged":
                raise ValueError(f"cache must be 'contiguous', 'paged' or a cache object, got {cache!r}")
            num_blocks = num_blocks or self.max_batch * -(-self.w.block_size // block_len)
            kind = PrefixCachingKVCache if prefix_cache else PagedKVCache
            return kind.for_decoder(self.w, self.max_batch, num_blocks, block_len)
        if not all(hasattr(cache, a) for a in ("reserve", "release", "locate", "lengths", "n_slots")):
            raise ValueError(f"Scheduler: cache must be 'contiguous', 'paged' or a KV cache object, "
                             f"got {type(cache).__name__}")
        if cache.n_slots < self.max_batch:
            raise ValueError(f"Scheduler: the cache has {cache.n_slots} slots for max_batch "
                             f"{self.max_batch}; pass one with >= {self.max_batch} slots")
        if prefix_cache and not isinstance(cache, PrefixCachingKVCache):
            raise ValueError(f"Scheduler: prefix_cache=True with a {type(cache).__name__}; pass a "
                             "PrefixCachingKVCache (or leave cache unset)")
        return cache

    # -- the queue --------------------------------------------------------------------------------
    def submit(self, req: Request):
        check_ids([req.id], 1, taken=self.rngs)  # a duplicate is refused: its answer would replace one
        req.prompt = check_prompt(req.prompt, self.w.block_size, req.max_new_tokens, f"request {req.id}",
                                  self.w.vocab_size)
        cap = self.cache.max_len if not isinstance(self.cache, PagedKVCache) else \
            self.cache.num_blocks * self.cache.block_len
        if len(req.prompt) + req.max_new_tokens > cap:
            raise ValueError(f"request {req.id}: {len(req.prompt) + req.max_new_tokens} tokens can never fit "
                             f"the cache ({cap} positions)")
        self.rngs[req.id] = req.sampling.generator(req.id)
        self.pending.append(req)

    def _arrivals(self):
        new = [r for r in self.pending if r.arrival <= self.t]
        self.pending = [r for r in self.pending if r.arrival > self.t]
        for r in new:
            r.arrived_s = now()
        self.waiting.extend(sorted(new, key=lambda r: (r.arrival, r.id)))

    def _admit(self) -> list:
        """Slots refilled this step: (slot, request) pairs whose whole history is fed (prefill)."""
        if self.policy == "static" and self.running:
            return []
        free = [s for s in range(self.max_batch) if s not in self.running]
        new = []
        while free and self.waiting:
            req, slot = self.waiting[0], free[0]
            tokens = req.prompt + req.out
            hit = self.cache.match(slot, tokens) if self.sharing else 0
            try:
                self.cache.reserve(slot, len(tokens))
            except OutOfBlocks:
                if hit:
                    self.cache.release(slot)  # its shared blocks go back, still cached
                break
            self.waiting.popleft()
            free.pop(0)
            self.hits[slot] = hit
            if self.sharing:
                self.stats["looked_up_tokens"] += len(tokens)
                self.stats["hit_tokens"] += hit
            req.admitted = self.t if req.admitted is None else req.admitted
            self.running[slot] = req
            new.append(slot)
        return new

    def _preempt_for(self, slot) -> bool:
        """Free blocks for ``slot``'s next token by preempting the newest other sequences."""
        while True:
            try:
                self.cache.reserve(slot, int(self.cache.lengths[slot]) + 1)
                return True
            except OutOfBlocks:
                victims = [s for s in self.running if s != slot]
                victim = victims[-1] if victims else slot
                req = self.running.pop(victim)
                self.cache.release(victim)
                req.preemptions += 1
                self.stats["preemptions"] += 1
                self.waiting.appendleft(req)
                if victim == slot:
                    return False

    def install(self, req: Request, k, v, rng) -> bool:
        """Admit a request prefilled elsewhere (disaggregated serving, ``disaggregated.py``): its
        prompt's keys and values ``k[layer]``, ``v[layer]`` (1, H, T, D) go into a free slot, its
        first token is already in ``req.out`` and ``rng`` is its generator as the prefill left it.
        It then decodes like any running request. False (nothing changed) when no slot or block is
        free."""
        free = [s for s in range(self.max_batch) if s not in self.running]
        t = len(req.prompt)
        if not free:
            return False
        try:
            self.cache.reserve(free[0], t)
        except OutOfBlocks:
            return False
        slot, one = free[0], np.ones((1, t), dtype=bool)
        where = self.cache.locate(np.array([slot]), np.arange(t)[None], one)
        for layer in range(len(self.cache.k)):
            self.cache.write(layer, where, k[layer], v[layer])
        self.cache.lengths[slot] = t
        req.admitted = self.t
        self.running[slot], self.rngs[req.id] = req, rng
        return True

    # -- one step ---------------------------------------------------------------------------------
    def _forward(self, slots, feed, new):
        """Last logits of every running row: decodes (one token each) and prefills as two passes,
        so one-token rows are not padded to the longest prompt."""
        decodes = [i for i, s in enumerate(slots) if s not in new]
        groups = [decodes, [i for i, s in enumerate(slots) if s in new]]
        logits = [None] * len(slots)
        with no_grad():
            for rows in groups:
                if rows:
                    f = [feed[i] for i in rows]
                    out = forward_tokens(self.w, self.cache, [slots[i] for i in rows], f)
                    out = host(last_logits(out, f))
                    for r, i in enumerate(rows):
                        logits[i] = out[r]
        return logits

    def _commit(self, slots, reqs):
        """Index the blocks this pass filled (only slots that crossed a block boundary build the list)."""
        c = self.cache
        for slot, req in zip(slots, reqs):
            if int(c.lengths[slot]) // c.block_len > int(c.committed[slot]):
                c.commit(slot, req.prompt + req.out)

    def step(self) -> list:
        """Admit, decode one token for every running request, retire; returns requests finished now."""
        self._arrivals()
        new = set(self._admit())
        for slot in [s for s in self.running if s not in new]:
            if slot in self.running:
                self._preempt_for(slot)
        slots = list(self.running)
        self.history.append({s: self.running[s].id for s in slots})
        finished = []
        if slots:
            reqs = [self.running[s] for s in slots]
            feed = [[r.out[-1]] if s not in new else (r.prompt + r.out)[self.hits[s]:] if self.hits[s]
                    else r.prompt + r.out for s, r in zip(slots, reqs)]
            mem = self.cache.memory(slots)
            logits = self._forward(slots, feed, new)
            if self.sharing:
                self._commit(slots, reqs)
            for row, (slot, req) in enumerate(zip(slots, reqs)):
                req.out.append(sample(logits[row][None], req.sampling, [self.rngs[req.id]], [req.id],
                                      len(req.out))[0])
                if req.ttft_s is None and req.arrived_s is not None:
                    req.ttft_s = now() - req.arrived_s
                if req.done:
                    req.finished = self.t
                    finished.append(self.running.pop(slot))
                    self.cache.release(slot)
            self.stats["tokens"] += len(slots)
            self.stats["forward_rows"] += sum(len(f) for f in feed)
            self.stats["peak_reserved"] = max(self.stats["peak_reserved"], mem["reserved"])
            self.stats["peak_used"] = max(self.stats["peak_used"], mem["used"])
        self.t += 1
        self.stats["steps"] += 1
        self.done.extend(finished)
        return finished

    def has_work(self) -> bool:
        return bool(self.pending or self.waiting or self.running)

    def run(self, requests) -> dict:
        """Serve every request to completion; returns {id: generated tokens}."""
        for r in requests:
            self.submit(r)
        for r in [r for r in self.pending if r.max_new_tokens == 0]:
            self.pending.remove(r)
            r.finished = r.arrival
            self.done.append(r)
        t0 = now()
        while self.has_work():
            self.step()
        self.stats["seconds"] = now() - t0
        if self.sharing:
            looked = self.stats["looked_up_tokens"]
            self.stats["hit_rate"] = self.stats["hit_tokens"] / looked if looked else 0.0
            self.stats["prefill_tokens_saved"] = self.stats["hit_tokens"]
        return {r.id: list(r.out) for r in sorted(self.done, key=lambda r: r.id)}


def serve(model, requests, max_batch=8, policy="continuous", **cache_kw):
    """Run a fresh Scheduler over copies of ``requests``; returns (tokens by id, stats, finished requests);
    ``stats["history"]``: the per-step slot occupancy ({slot: request id})."""
    reqs = [Request(r.id, r.prompt, r.max_new_tokens, r.sampling, tuple(r.stop_tokens), r.arrival)
            for r in requests]
    s = Scheduler(model, max_batch=max_batch, policy=policy, **cache_kw)
    out = s.run(reqs)
    s.stats["history"] = s.history
    return out, s.stats, sorted(s.done, key=lambda r: r.id)
