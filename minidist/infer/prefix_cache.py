"""Prefix caching (vLLM's hashed blocks): requests that share a prompt prefix share its KV blocks.

Two requests with the same system prompt compute the same keys and values for it: position p's
K/V depends only on tokens 0..p. So a *full* block of the paged cache is named by its tokens and
everything before them -- the chain hash ``h_i = hash_fn(h_{i-1}, tokens of block i)`` -- and a
new request whose leading blocks are already cached attaches them to its block table instead of
recomputing them; its prefill starts after the hit:

    match(slot, prompt)   -> tokens already cached (whole blocks; at most len(prompt) - 1, so the
                             last prompt token is always fed: its logits sample the first new token)
    reserve / forward_tokens(prompt[hit:]) / commit(slot, tokens)   -- full blocks become cached
    release(slot)         -> blocks no one uses stay cached, evictable, least recently used first

A cached block has a reference count (the slots using it). A block with users is never evicted
and never written: a slot writes only past its hit, into blocks of its own. When ``reserve`` finds
the free list empty it evicts the least recently used cached block with no users (a slot's
blocks go back last-block-first, so a prompt's tail is evicted before its shared head). A hash
only finds candidates: a hit also needs the block's whole token prefix to be equal, so a hash
collision (``hash_fn`` is a parameter; the tests force collisions with a tiny one) never shares
a wrong block.

``stats()`` gives what a lesson or a benchmark prints: the hit rate (prompt tokens found cached /
prompt tokens looked up), the prefill tokens saved, evictions. ``generate_with_prefix_cache`` is
the serving loop the tests compare token by token with plain ``generate``.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import numpy as np

from minidist.infer.decoder import as_decoder, forward_tokens, last_logits
from minidist.infer.generate import check_prompts, decode_loop, host
from minidist.infer.paged import PagedKVCache
from minidist.infer.sampling import GREEDY

ROOT = 0  # the chain hash before the first block


def block_hash(parent: int, tokens: tuple) -> int:
    """The default ``hash_fn``: Python's hash of (parent hash, the block's tokens) -- deterministic
    for integers across runs."""
    return hash((parent, tokens))


class PrefixCachingKVCache(PagedKVCache):
    """A ``PagedKVCache`` whose full blocks are shared between sequences with the same prefix.

    Same constructor (and ``for_decoder``) plus ``hash_fn(parent_hash, block_tokens) -> int``."""

    def __init__(self, *args, hash_fn=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.hash_fn = hash_fn or block_hash
        self.refs = np.zeros(self.num_blocks, dtype=np.int64)  # users of each block
        self.by_hash: dict = {}      # hash -> cached block ids with that hash
        self.prefix_of: dict = {}    # cached block -> (its hash, the token prefix it ends)
        self.idle = OrderedDict()    # cached blocks with no users, least recently used first
        self.committed = np.zeros(self.n_slots, dtype=np.int64)  # a slot's leading blocks in the index
        self.chain = [[] for _ in range(self.n_slots)]           # their hashes
        self.looked_up = self.hit = self.evictions = 0

    @classmethod
    def for_decoder(cls, decoder, n_slots, num_blocks, block_len=16, max_len=None, hash_fn=None):
        n_layer, n_head, head_dim, dtype, backend = cls.layout_of(decoder)
        return cls(n_layer, n_slots, n_head, head_dim, num_blocks, block_len,
                   max_len or decoder.block_size, dtype=dtype, backend=backend, hash_fn=hash_fn)

    # -- sharing --------------------------------------------------------------------------------
    def match(self, slot: int, tokens) -> int:
        """Attach the cached blocks of ``tokens``' longest cached prefix to the empty ``slot``; its
        length becomes the tokens they hold, returned (what the prefill may skip)."""
        if self.n_blocks[slot] or self.lengths[slot]:
            raise ValueError(f"prefix cache: match(slot {slot}) needs an empty slot; it holds "
                             f"{int(self.lengths[slot])} tokens (release it first)")
        tokens = [int(t) for t in tokens]
        parent, hits, bl = ROOT, 0, self.block_len
        for i in range((len(tokens) - 1) // bl):
            h = self.hash_fn(parent, tuple(tokens[i * bl:(i + 1) * bl]))
            prefix = tuple(tokens[:(i + 1) * bl])
            block = next((b for b in self.by_hash.get(h, ()) if self.prefix_of[b][1] == prefix), None)
            if block is None:
                break
            if self.refs[block] == 0:
                del self.idle[block]
            self.refs[block] += 1
            self.tables[slot, i] = block
            self.chain[slot].append(h)
            parent, hits = h, i + 1
        self.n_blocks[slot] = self.committed[slot] = hits
        self.lengths[slot] = hits * bl
        self.looked_up += len(tokens)
        self.hit += hits * bl
        return hits * bl

    def commit(self, slot: int, tokens):
        """Index the slot's full blocks not indexed yet; ``tokens``: every token the slot holds."""
        n = int(self.lengths[slot])
        if len(tokens) < n:
            raise ValueError(f"prefix cache: commit(slot {slot}) got {len(tokens)} tokens for the "
                             f"{n} it holds; pass all of them (prompt + generated)")
        bl = self.block_len
        for i in range(int(self.committed[slot]), n // bl):
            parent = self.chain[slot][-1] if self.chain[slot] else ROOT
            h = self.hash_fn(parent, tuple(int(t) for t in tokens[i * bl:(i + 1) * bl]))
            prefix = tuple(int(t) for t in tokens[:(i + 1) * bl])
            twins = [b for b in self.by_hash.get(h, ()) if self.prefix_of[b][1] == prefix]
            if not twins:  # (a twin: another slot computed the same prefix at the same time)
                block = int(self.tables[slot, i])
                self.by_hash.setdefault(h, []).append(block)
                self.prefix_of[block] = (h, prefix)
            self.chain[slot].append(h)
            self.committed[slot] = i + 1

    def release(self, slot):
        super().release(slot)
        self.committed[slot] = 0
        self.chain[slot] = []

    # -- the pool, with sharing and eviction --------------------------------------------------------
    def available(self) -> int:
        return len(self.free) + len(self.idle)

    def take_block(self) -> int:
        if self.free:
            block = self.free.pop()
        else:  # evict the least recently used cached block that no one uses
            block, _ = self.idle.popitem(last=False)
            h, _ = self.prefix_of.pop(block)
            self.by_hash[h].remove(block)
            if not self.by_hash[h]:
                del self.by_hash[h]
            self.evictions += 1
        self.refs[block] = 1
        return block

    def give_block(self, block: int):
        self.refs[block] -= 1
        if self.refs[block] > 0:
            return
        if block in self.prefix_of:
            self.idle[block] = None  # cached, evictable: the most recently used
        else:
            self.free.append(block)

    # -- accounting -------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Prompt tokens looked up, found cached (= prefill tokens saved), the hit rate, blocks cached
        and evicted."""
        return {"looked_up_tokens": self.looked_up, "hit_tokens": self.hit,
                "hit_rate": self.hit / self.looked_up if self.looked_up else 0.0,
                "prefill_tokens_saved": self.hit, "cached_blocks": len(self.prefix_of),
                "idle_cached_blocks": len(self.idle), "evictions": self.evictions}

    def memory(self, active_slots=None) -> dict:
        out = super().memory(active_slots)
        out["free_blocks"] = self.available()
        return out


def generate_with_prefix_cache(model, prompts, max_new_tokens: int, cache: PagedKVCache,
                               sampling=GREEDY, stop_tokens=(), return_logits: bool = False, ids=None,
                               ttft: list | None = None):
    """``generate`` over a paged ``cache`` (slots 0..len(prompts)-1, released at the end): each
    prompt in turn looks up its cached prefix and prefills the rest, so later prompts also hit the
    earlier ones' blocks; decoding is batched. With a plain ``PagedKVCache`` nothing is shared.

    ``ttft``: a list to which each prompt's time to first token is appended (seconds from the
    call to its first token's logits), for a benchmark to set with and without sharing."""
    t0 = time.perf_counter()
    dec = as_decoder(model)
    prompts = check_prompts(prompts, dec.block_size, dec.vocab_size, max_new_tokens)
    if len(prompts) > cache.n_slots:
        raise ValueError(f"generate_with_prefix_cache: {len(prompts)} prompts for a cache of "
                         f"{cache.n_slots} slots; pass at most {cache.n_slots} per call")
    busy = [i for i in range(len(prompts)) if cache.n_blocks[i] or cache.lengths[i]]
    if busy:
        raise ValueError(f"generate_with_prefix_cache: slots {busy} of the cache are in use; it serves "
                         f"from slots 0..{len(prompts) - 1}, which must be released")
    held = [list(p) for p in prompts]  # the tokens each slot holds after this step
    sharing = hasattr(cache, "match")

    def feed_slot(i, toks):
        cache.reserve(i, int(cache.lengths[i]) + len(toks))
        logits = forward_tokens(dec, cache, [i], [toks])
        if sharing:
            cache.commit(i, held[i])
        out = host(last_logits(logits, [toks]))[0]
        if ttft is not None:
            ttft.append(time.perf_counter() - t0)
        return out

    def step(active, feed):
        if all(int(cache.lengths[i]) == 0 for i in active):  # prefill, one prompt at a time
            return np.stack([feed_slot(i, held[i][cache.match(i, held[i]) if sharing else 0:])
                             for i in active])
        for i, toks in zip(active, feed):
            held[i] += toks
            cache.reserve(i, len(held[i]))
        logits = host(last_logits(forward_tokens(dec, cache, active, feed), feed))
        if sharing:
            for i in active:
                cache.commit(i, held[i])
        return logits

    try:
        return decode_loop(step, prompts, max_new_tokens, sampling, stop_tokens, return_logits,
                           vocab_size=dec.vocab_size, ids=ids)
    finally:
        for i in range(len(prompts)):
            cache.release(i)
