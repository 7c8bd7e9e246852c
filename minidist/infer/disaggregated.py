"""Disaggregated serving: prefill on some ranks, decode on others, the prompt's KV cache sent between.

    served = disaggregated_serve(comm, model, requests, arrivals, prefill_ranks=1)   # ranks 0..P-1 prefill
    served = colocated_serve(comm, model, requests, arrivals)      # the baseline (colocated.py)

Request i (in arrival order) is prefilled on rank i % P, which samples its first token and sends
its prompt's keys and values (2 · n_layer · T · d_model · itemsize bytes), first token and generator
state to rank P + i % D; a decode rank installs arrived caches into its ``Scheduler`` between decode
steps and is never interrupted by a prefill. The tokens are colocated serving's, token for token.
Times are seconds since rank 0's clock (``trace.clock``) at the start. Chapter 9 has the trade.
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass, field
from math import inf

import numpy as np

from minidist.autograd.tensor import no_grad
from minidist.infer.decoder import as_decoder, forward_tokens, last_logits
from minidist.infer.generate import check_ids, check_prompt, host
from minidist.infer.kv_cache import KVCache
from minidist.infer.sampling import is_int, sample
from minidist.infer.scheduler import Scheduler
from minidist.trace.spans import arrival, now, sleep

META = 1  # the object tag of the (request id, first token, generator state) that precedes a cache


@dataclass
class Served:
    """What a serving run measured, the same on every rank."""

    outputs: dict                                 # request id -> generated tokens
    ttft: dict                                    # request id -> seconds from arrival to the first token
    tpot: dict                                    # request id -> seconds per token after the first
    kv_bytes: list = field(default_factory=list)  # per rank: payload bytes it sent (the caches)
    makespan: float = 0.0

    def summary(self) -> dict:
        """TTFT and TPOT, median and p90 (``ttft_p50`` ...), in seconds."""
        pct = lambda v, q: float(np.percentile(list(v.values()), q)) if v else 0.0  # noqa: E731
        return {f"{k}_p{q}": pct(getattr(self, k), q) for k in ("ttft", "tpot") for q in (50, 90)}


def kv_message_bytes(cfg, prompt_len: int, itemsize: int = 4) -> int:
    """Bytes of one request's prompt cache on the wire: keys and values, every layer, every token."""
    return 2 * cfg.n_layer * prompt_len * cfg.d_model * itemsize


def check_requests(comm, model, requests, arrivals, who="") -> tuple:
    """(requests in arrival order, their arrival seconds): every rank raises the same clear error
    before any message is sent."""
    cfg = as_decoder(model).config
    arrivals = [0.0] * len(requests) if arrivals is None else list(arrivals)
    if len(arrivals) != len(requests) or any(not a >= 0 for a in arrivals):
        raise ValueError(f"{who}give one arrival time >= 0 (seconds) per request: {len(requests)} requests, "
                         f"{len(arrivals)} arrivals")
    check_ids([r.id for r in requests], len(requests), who)
    for r in requests:
        check_prompt(r.prompt, cfg.block_size, r.max_new_tokens, f"{who}request {r.id}", cfg.vocab_size)
    order = sorted(range(len(requests)), key=lambda i: (arrivals[i], requests[i].id))
    return [requests[i] for i in order], [float(arrivals[i]) for i in order]


def gathered(comm, local: dict, sent: int, t0: float) -> Served:
    """Every rank's (outputs, first, last, arrival) merged; times turned into TTFT and TPOT."""
    parts = comm.allgather_obj((local, sent, now() - t0))
    out, first, last, arrival = {}, {}, {}, {}
    for part, _, _ in parts:
        for merged, d in zip((out, first, last, arrival), part):
            merged.update(d)
    ttft = {i: first[i] - arrival[i] for i in first}
    tpot = {i: (last[i] - first[i]) / (len(out[i]) - 1) for i in last if len(out[i]) > 1}
    return Served(dict(sorted(out.items())), ttft, tpot, [p[1] for p in parts], max(p[2] for p in parts))


def fingerprint(model, reqs, arrivals) -> tuple:
    """What every rank must share: its model's config (but the init seed) and weights, the requests."""
    dec, w, rq = as_decoder(model), hashlib.sha256(), hashlib.sha256()
    for m in (dec.embed, *dec.blocks, dec.head):
        for name, a in m.state_dict().items():
            w.update(name.encode() + host(a).tobytes())
    rq.update(repr([(int(r.id), [int(t) for t in np.ravel(r.prompt)], int(r.max_new_tokens), r.sampling,
                     r.stop_tokens, a) for r, a in zip(reqs, arrivals)]).encode())
    return vars(dec.config) | {"seed": None}, w.hexdigest()[:16], (len(reqs), rq.hexdigest()[:16])


def start(comm, model, reqs, arrivals, who="") -> float:
    """The shared time zero (rank 0's clock), once every rank has seen the others' ``fingerprint``: a
    rank given another model or other requests is named at once, on every rank, before anything is sent."""
    views = comm.allgather_obj((*fingerprint(model, reqs, arrivals), now()))
    for k, what in enumerate(("model config", "model weights (sha256)", "requests (count, sha256)")):
        odd = [r for r, v in enumerate(views) if v[k] != views[0][k]]
        if odd:
            a, b = views[odd[0]][k], views[0][k]
            if k == 0:  # only the fields that differ
                a, b = [{f: c[f] for f in c if a.get(f) != b.get(f)} for c in (a, b)]
            raise ValueError(f"{who}ranks {odd} hold other {what} than rank 0 ({a} against {b}): "
                             "every rank must be given the same model and the same requests")
    return views[0][-1]


def disaggregated_serve(comm, model, requests, arrivals=None, prefill_ranks: int = 1, max_batch: int = 4,
                        **scheduler_kw) -> Served:
    """Serve ``requests`` with ranks 0..prefill_ranks-1 prefilling and the rest decoding (see above).
    Returns the same ``Served`` on every rank; ``kv_bytes[r]``: the cache bytes rank r sent."""
    who = f"rank {comm.rank}: "
    p = prefill_ranks
    if not (is_int(p) and 1 <= p < comm.size):
        raise ValueError(f"{who}prefill_ranks must be an integer in 1..{comm.size - 1} (at least one rank "
                         f"must be left to decode, of {comm.size}), got {p!r}")
    reqs, arr = check_requests(comm, model, requests, arrivals, who)
    d = comm.size - p
    plan = [(r, a, i % p, p + i % d) for i, (r, a) in enumerate(zip(reqs, arr))]
    t0 = start(comm, model, reqs, arr, who)
    if comm.rank < p:
        local, sent = prefill_rank(comm, model, [x for x in plan if x[2] == comm.rank], t0)
    else:
        local, sent = decode_rank(comm, model, [x for x in plan if x[3] == comm.rank], t0, max_batch,
                                  scheduler_kw), 0
    return gathered(comm, local, sent, t0)


def prefill_rank(comm, model, plan, t0) -> tuple:
    """Prefill each request at its arrival; send its cache on. Returns (times, payload bytes sent)."""
    dec = as_decoder(model)
    out, first, arrival, sends, sent = {}, {}, {}, [], 0
    with no_grad():
        for r, a, _, dest in plan:
            sleep(t0 + a - now())
            arrival[r.id] = a
            rng, t = r.sampling.generator(r.id), len(r.prompt)
            if r.max_new_tokens == 0:
                tok, kv = None, np.zeros(0, np.float32)
            else:
                cache = KVCache.for_decoder(dec, 1, t)
                logits = host(last_logits(forward_tokens(dec, cache, [0], [r.prompt]), [r.prompt]))
                tok = sample(logits, r.sampling, [rng], [r.id])[0]
                first[r.id] = now() - t0
                done = r.max_new_tokens == 1 or tok in r.stop_tokens
                xp = cache.be.xp
                kv = np.zeros(0, np.float32) if done else xp.stack([xp.stack(cache.k), xp.stack(cache.v)])
            if kv.size == 0:  # nothing left to decode: the answer is complete here
                out[r.id] = [] if tok is None else [tok]
            comm.send_obj((r.id, tok, rng.bit_generator.state), dest, tag=META)
            sends.append(comm.isend(kv, dest))
            sent += int(kv.nbytes)
    for s in sends:
        s.wait()
    return (out, first, {}, arrival), sent


def decode_rank(comm, model, plan, t0, max_batch, scheduler_kw) -> tuple:
    """Install caches as they arrive and decode everything installed, one token per step."""
    sched = Scheduler(model, max_batch=max_batch, **scheduler_kw)
    expect = {}  # prefill rank -> its requests for this rank, in the order it sends them
    for r, _, src, _ in plan:
        expect.setdefault(src, deque()).append(r)
    posted = {src: comm.irecv(src) for src in expect}
    ready, out, last, at = deque(), {}, {}, {}  # at: when each source's next cache arrives
    while posted or ready or sched.has_work():
        at = {s: at[s] if at.get(s, inf) < inf else arrival(q, comm.clock) for s, q in posted.items()}
        for src in [s for s in at if at[s] <= now()]:
            kv = posted.pop(src).wait()
            _, tok, state = comm.recv_obj(src, tag=META)  # start() checked both ranks plan the same
            r = expect[src].popleft()
            if expect[src]:
                posted[src], at[src] = comm.irecv(src), inf
            if kv.size == 0:
                continue  # answered by the prefill
            rng = np.random.default_rng()
            rng.bit_generator.state = state
            r.out = [tok]
            ready.append((r, kv, rng))
        while ready and sched.install(ready[0][0], ready[0][1][0], ready[0][1][1], ready[0][2]):
            ready.popleft()
        if not sched.has_work():
            if posted and min(at.values()) == inf:
                comm.wait_any(list(posted.values()), "a prefilled request's cache")
            elif posted:  # the virtual clock: idle until the first cache arrives
                sleep(min(at.values()) - now())
            continue
        finished = sched.step()
        for r in finished:
            out[r.id], last[r.id] = list(r.out), now() - t0
    return out, {}, last, {}
