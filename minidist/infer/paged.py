"""The paged KV cache: fixed-size blocks from one pool, a block table per sequence, a free list.

    token at position p of the sequence in slot s  ->  block tables[s][p // block_len], offset p % block_len

Blocks are taken only as a sequence grows, so waste is under one block per sequence. When the pool
runs dry ``reserve`` raises ``OutOfBlocks`` (the scheduler then preempts). The interface is
``KVCache``'s, so the decoder and the scheduler don't know which cache they use.
"""

from __future__ import annotations

import numpy as np

from minidist.accel import compiled
from minidist.infer.buckets import array_where
from minidist.infer.kv_cache import CacheStorage, valid_tokens


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than a reservation needs."""


class PagedKVCache(CacheStorage):
    def __init__(self, n_layer, n_slots, n_head, head_dim, num_blocks, block_len=16, max_len=None,
                 dtype="float32", backend=None):
        if num_blocks < 1 or block_len < 1:
            raise ValueError(f"PagedKVCache needs num_blocks >= 1 and block_len >= 1, "
                             f"got {num_blocks}, {block_len}")
        self.allocate(n_layer, (num_blocks, n_head, block_len, head_dim), dtype, backend)
        self.block_len, self.num_blocks, self.n_slots = block_len, num_blocks, n_slots
        self.max_len = max_len or num_blocks * block_len
        self.max_blocks = -(-self.max_len // block_len)
        self.tables = np.zeros((n_slots, self.max_blocks), dtype=np.int64)  # block ids per slot
        self.n_blocks = np.zeros(n_slots, dtype=np.int64)  # how many of a slot's table entries are real
        self.free = list(range(num_blocks - 1, -1, -1))  # the free list (pop from the end)
        self.lengths = np.zeros(n_slots, dtype=np.int64)

    @classmethod
    def for_decoder(cls, decoder, n_slots, num_blocks, block_len=16, max_len=None):
        """A pool shaped for a ``minidist.infer.Decoder`` (this rank's heads and layers)."""
        n_layer, n_head, head_dim, dtype, backend = cls.layout_of(decoder)
        return cls(n_layer, n_slots, n_head, head_dim, num_blocks, block_len,
                   max_len or decoder.block_size, dtype=dtype, backend=backend)

    # -- blocks ---------------------------------------------------------------------------------
    def blocks_needed(self, slot, length) -> int:
        return max(0, -(-length // self.block_len) - int(self.n_blocks[slot]))

    def reserve(self, slot, length):
        """Give ``slot`` enough blocks for ``length`` tokens, or raise OutOfBlocks (taking none)."""
        if length > self.max_len:
            raise ValueError(f"paged KV cache slot {slot}: {length} tokens exceed max_len {self.max_len}")
        need = self.blocks_needed(slot, length)
        if need > self.available():
            raise OutOfBlocks(f"slot {slot} needs {need} more blocks for {length} tokens; "
                              f"{self.available()} of {self.num_blocks} free")
        for _ in range(need):
            self.tables[slot, self.n_blocks[slot]] = self.take_block()
            self.n_blocks[slot] += 1

    def release(self, slot):
        """Return the slot's blocks to the free list."""
        n = int(self.n_blocks[slot])
        for b in self.tables[slot, :n][::-1]:
            self.give_block(int(b))
        self.n_blocks[slot] = 0
        self.lengths[slot] = 0

    # the pool's bookkeeping, which the prefix cache (``prefix_cache.py``) refines with sharing
    def available(self) -> int:
        """Blocks a reservation can take now."""
        return len(self.free)

    def take_block(self) -> int:
        return self.free.pop()

    def give_block(self, block: int):
        self.free.append(block)

    # -- what the decoder calls -------------------------------------------------------------------
    def index(self, slots):
        return slots

    def locate(self, slots, pos, valid):
        """The block and offset of each valid new token (once per forward pass, for every layer)."""
        take, s, p = valid_tokens(slots, pos, valid)
        past = np.atleast_1d(p // self.block_len >= self.n_blocks[s])
        if past.any():
            bad = int(np.atleast_1d(s)[np.argmax(past)])
            raise RuntimeError(f"paged KV cache: slot {bad} writes past its blocks; call reserve() first")
        block, offset = self.tables[s, p // self.block_len], p % self.block_len
        if self.bucketed:
            return array_where(block, offset, take, len(slots))
        return (block, slice(None), offset), take

    def read(self, layer, rows, tk):
        """Gather each row's blocks into (B, H, tk, D) (rows past a sequence's end hold junk: masked)."""
        return self.take(self.k[layer], self.v[layer], rows, tk)

    def take(self, k_pool, v_pool, rows, tk):
        nb = -(-tk // self.block_len)
        ids = self.tables[rows, :nb]  # (B, nb); entries past n_blocks point at block 0 (masked anyway)
        return gather_blocks(k_pool, v_pool, ids, tk)

    # -- accounting -------------------------------------------------------------------------------
    def memory(self, active_slots=None) -> dict:
        """Bytes in allocated blocks vs bytes holding tokens; the pool's size beside them."""
        slots = range(self.n_slots) if active_slots is None else list(active_slots)
        per_tok = self.bytes_per_token()
        alloc = int(sum(int(self.n_blocks[s]) for s in slots)) * self.block_len * per_tok
        used = int(sum(int(self.lengths[s]) for s in slots)) * per_tok
        return {"reserved": alloc, "used": used, "waste": alloc - used,
                "pool": self.num_blocks * self.block_len * per_tok, "free_blocks": len(self.free)}


@compiled.pure  # on JAX one compiled call per (rows, blocks) shape, the block ids an argument
def gather_blocks(k_pool, v_pool, ids, tk: int):
    """Each row's blocks ``ids`` (B, nb) of both pools, laid end to end: (B, H, tk, D) each."""
    out = []
    for pool in (k_pool, v_pool):
        g = pool[ids]  # (B, nb, H, L, D)
        b, nb, h, l, d = g.shape
        out.append(g.transpose(0, 2, 1, 3, 4).reshape(b, h, nb * l, d)[:, :, :tk])
    return out[0], out[1]
