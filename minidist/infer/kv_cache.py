"""The contiguous KV cache: per layer, one preallocated (slots, heads, max_len, head_dim) block.

Decoding token t needs the keys and values of tokens 0..t-1 in every layer. Recomputing them
costs a full forward pass over the whole sequence per new token (O(T²) work for T tokens);
keeping them costs memory: 2 · n_layer · max_len · d_model numbers per sequence, reserved up front.

A *slot* is one sequence's row. ``lengths[slot]`` counts the tokens cached there; a sequence's
token at position p lives at ``k[layer][slot, :, p]``. ``paged.py`` has the same interface
(``index``, ``write``, ``read``, ``lengths``, ``reserve``, ``release``, ``memory``) with blocks.
"""

from __future__ import annotations

import numpy as np

from minidist.backend import default_backend, get_backend


class CacheStorage:
    """What the contiguous and the paged cache share: per layer, a k and a v array (rows, H, L, D)."""

    def allocate(self, n_layer, shape, dtype, backend):
        """Zeroed ``self.k``, ``self.v`` of ``shape`` per layer (written with ``Backend.set_at``: in
        place on NumPy and CuPy, a new array per step on JAX)."""
        self.be = get_backend(backend) if backend is not None else default_backend()
        self.k = [self.be.xp.zeros(shape, dtype=dtype) for _ in range(n_layer)]
        self.v = [self.be.xp.zeros(shape, dtype=dtype) for _ in range(n_layer)]

    @staticmethod
    def dims_of(weights) -> tuple:
        """(n_layer, n_head, head_dim) of ``GPTWeights`` (this rank's heads and layers)."""
        blk = weights.blocks[0] if weights.blocks else None
        n_head = blk.n_head if blk else 1
        head_dim = blk.qkv_w.shape[1] // (3 * n_head) if blk else 1
        return len(weights.blocks), n_head, head_dim

    def bytes_per_token(self) -> int:
        k = self.k[0] if self.k else None
        return 0 if k is None else 2 * len(self.k) * k.shape[1] * k.shape[3] * k.dtype.itemsize


class KVCache(CacheStorage):
    def __init__(self, n_layer, n_slots, n_head, head_dim, max_len, dtype="float32", backend=None):
        self.allocate(n_layer, (n_slots, n_head, max_len, head_dim), dtype, backend)
        self.lengths = np.zeros(n_slots, dtype=np.int64)
        self.max_len, self.n_slots = max_len, n_slots

    @classmethod
    def for_weights(cls, weights, n_slots, max_len=None, backend=None) -> KVCache:
        """A cache shaped for ``GPTWeights`` (this rank's heads and layers)."""
        n_layer, n_head, head_dim = cls.dims_of(weights)
        return cls(n_layer, n_slots, n_head, head_dim, max_len or weights.block_size, dtype=weights.dtype,
                   backend=backend)

    # -- what the decoder calls -------------------------------------------------------------------
    def index(self, slots):
        """How to select these rows: a slice (a view, no copy) when they are consecutive."""
        s0 = int(slots[0])
        if np.array_equal(slots, np.arange(s0, s0 + len(slots))):
            return slice(s0, s0 + len(slots))
        return slots

    def write(self, layer, slots, pos, valid, k, v):
        """Store k, v (B, H, T, D) of the valid tokens at their positions ``pos`` (B, T)."""
        b, t = np.nonzero(valid)
        p = pos[b, t]
        if int(p.max()) >= self.max_len:
            raise ValueError(f"KV cache: position {int(p.max())} is past max_len {self.max_len}")
        s = slots[b]
        self.k[layer] = self.be.set_at(self.k[layer], (s, slice(None), p), k.transpose(0, 2, 1, 3)[b, t])
        self.v[layer] = self.be.set_at(self.v[layer], (s, slice(None), p), v.transpose(0, 2, 1, 3)[b, t])

    def read(self, layer, rows, tk):
        """Keys and values of positions 0..tk-1 for these rows: (B, H, tk, D)."""
        return self.k[layer][rows, :, :tk], self.v[layer][rows, :, :tk]

    # -- what a scheduler calls -------------------------------------------------------------------
    def reserve(self, slot, length):
        """Make room for ``length`` tokens in ``slot`` (contiguous: already reserved, just check)."""
        if length > self.max_len:
            raise ValueError(f"KV cache slot {slot}: {length} tokens don't fit max_len {self.max_len}")

    def release(self, slot):
        self.lengths[slot] = 0

    def memory(self, active_slots=None) -> dict:
        """Bytes reserved vs bytes holding real tokens (for active slots, default all)."""
        slots = range(self.n_slots) if active_slots is None else list(active_slots)
        per_tok = self.bytes_per_token()
        reserved = self.n_slots * self.max_len * per_tok
        used = int(sum(int(self.lengths[s]) for s in slots)) * per_tok
        return {"reserved": reserved, "used": used, "waste": reserved - used}
