"""Prefix caching (vLLM's hashed blocks): requests that share a prompt prefix share its KV blocks.

A full block of the paged cache is named by the chain hash of its tokens and everything before
them, ``h_i = hash_fn(h_{i-1}, tokens of block i)``; a new request attaches the cached blocks of its
longest cached prefix and prefills only the rest:

    match(slot, prompt)   -> tokens already cached (whole blocks, at most len(prompt) - 1)
    reserve / forward_tokens(prompt[hit:]) / commit(slot, tokens)   -- full blocks become cached
    release(slot)         -> blocks no one uses stay cached, evicted least recently used first

A block with users is never written or evicted, and a hit also needs the block's whole token
prefix to be equal, so a hash collision never shares a wrong block. Chapter 9 has the details.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from minidist.infer.paged import PagedKVCache

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
