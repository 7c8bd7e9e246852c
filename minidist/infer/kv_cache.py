"""The contiguous KV cache: per layer, one preallocated (slots, heads, max_len, head_dim) block.

A *slot* is one sequence's row; ``lengths[slot]`` counts its cached tokens, and its token at
position p lives at ``k[layer][slot, :, p]``. ``paged.py`` has the same interface (``index``,
``locate``, ``write``, ``read``, ``lengths``, ``reserve``, ``release``, ``memory``) over blocks.
``CacheStep`` is what a model sees of one forward pass (rows, positions, the causal mask) and
``step.layer(i)`` block i's view: its ``update(k, v)`` stores the new keys and values and returns
every cached one. On JAX the keys are read in power-of-two buckets (``buckets.py``), so decoding T
tokens compiles O(log T) programs.
"""

from __future__ import annotations

import numpy as np

from minidist.accel import compiled
from minidist.accel.backend import default_backend, get_backend
from minidist.infer.buckets import array_where, bucket, compiles_per_shape


class CacheStorage:
    """What the contiguous and the paged cache share: per layer, a k and a v array (rows, H, L, D)."""

    def allocate(self, n_layer, shape, dtype, backend):
        """Zeroed ``self.k``, ``self.v`` of ``shape`` per layer (written with ``Backend.set_at``: in
        place on NumPy and CuPy, a new array per step on JAX)."""
        self.be = get_backend(backend) if backend is not None else default_backend()
        self.bucketed = compiles_per_shape(self.be)  # JAX: bucketed reads, positions as arguments
        self.k = [self.be.xp.zeros(shape, dtype=dtype) for _ in range(n_layer)]
        self.v = [self.be.xp.zeros(shape, dtype=dtype) for _ in range(n_layer)]

    @staticmethod
    def layout_of(decoder) -> tuple:
        """(n_layer, kv heads, head_dim, dtype, backend) of a ``Decoder``'s blocks: this rank's layers
        and K/V heads (``Decoder.cache_dims``), its parameters' dtype and array library."""
        p = decoder.first_parameter
        return (*decoder.cache_dims, p.dtype, p.backend)

    def write(self, layer, where, k, v):
        """Store k, v (B, H, T, D) of the new tokens where ``locate`` said."""
        self.k[layer], self.v[layer] = self.put(self.k[layer], self.v[layer], where, k, v)

    def put(self, k_all, v_all, where, k, v):
        """``k_all``, ``v_all`` (rows, H, L, X) with the new tokens' k, v (B, H, T, X) stored where
        ``locate`` said (any X: the int8 cache stores its scales, X = 1, the same way)."""
        if self.bucketed:
            return store(k_all, v_all, where, k, v)
        index, take = where
        be = self.be
        return be.set_at(k_all, index, new_tokens(k, take)), be.set_at(v_all, index, new_tokens(v, take))

    def arrays(self) -> list:
        """Every array the cache holds (what its memory is)."""
        return [*self.k, *self.v]

    def bytes_per_token(self) -> int:
        """Bytes one cached position costs, measured from the arrays: their bytes / positions."""
        if not self.k:
            return 0
        positions = self.k[0].shape[0] * self.k[0].shape[2]
        return sum(int(a.nbytes) for a in self.arrays()) // positions


class KVCache(CacheStorage):
    def __init__(self, n_layer, n_slots, n_head, head_dim, max_len, dtype="float32", backend=None):
        self.allocate(n_layer, (n_slots, n_head, max_len, head_dim), dtype, backend)
        self.lengths = np.zeros(n_slots, dtype=np.int64)
        self.max_len, self.n_slots = max_len, n_slots

    @classmethod
    def for_decoder(cls, decoder, n_slots, max_len=None) -> KVCache:
        """A cache shaped for a ``minidist.infer.Decoder`` (this rank's heads and layers)."""
        n_layer, n_head, head_dim, dtype, backend = cls.layout_of(decoder)
        return cls(n_layer, n_slots, n_head, head_dim, max_len or decoder.block_size, dtype=dtype,
                   backend=backend)

    # -- what the decoder calls -------------------------------------------------------------------
    def index(self, slots):
        """How to select these rows: a slice (a view, no copy) when they are consecutive; bucketed,
        always the array (an argument of the compiled read, whichever rows)."""
        if self.bucketed:
            return np.asarray(slots, dtype=np.int64)
        s0 = int(slots[0])
        if len(slots) == 1 or np.array_equal(slots, np.arange(s0, s0 + len(slots))):
            return slice(s0, s0 + len(slots))
        return slots

    def locate(self, slots, pos, valid):
        """Where the valid new tokens (positions ``pos`` (B, T)) of rows ``slots`` go: computed once per
        forward pass, used by every layer's ``write``."""
        take, s, p = valid_tokens(slots, pos, valid)
        if int(np.max(p)) >= self.max_len:
            raise ValueError(f"KV cache: position {int(np.max(p))} is past max_len {self.max_len}")
        return array_where(s, p, take, len(slots)) if self.bucketed else ((s, slice(None), p), take)

    def read(self, layer, rows, tk):
        """Keys and values of positions 0..tk-1 for these rows: (B, H, tk, D)."""
        return self.take(self.k[layer], self.v[layer], rows, tk)

    def take(self, k_all, v_all, rows, tk):
        if self.bucketed:
            return prefix(k_all, v_all, rows, tk)
        return k_all[rows, :, :tk], v_all[rows, :, :tk]

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


@compiled.pure
def store(k_all, v_all, where, k, v):
    """``write`` as one compiled call on JAX: rows, positions and ``take`` are arguments."""
    (rows, positions), take = where
    return (k_all.at[rows, :, positions].set(new_tokens(k, take)),
            v_all.at[rows, :, positions].set(new_tokens(v, take)))


@compiled.pure
def prefix(k, v, rows, tk: int):
    """Positions 0..tk-1 of ``rows`` (an index array) of k and v: one compiled read per (rows, tk)
    shape on JAX, the rows an argument."""
    return k[rows, :, :tk], v[rows, :, :tk]


def valid_tokens(slots, pos, valid):
    """(take, slot, position) of the valid new tokens: ``take`` picks them out of keys or values
    transposed to (B, T, H, D). Decoding (one token per row, no padding) needs no search, and
    decoding one sequence -- the common case -- gets plain integers: basic indexing, no gathers."""
    if valid.shape == (1, 1):
        return (0, 0), int(slots[0]), int(pos[0, 0])
    if valid.shape[1] == 1 and valid.all():
        return (slice(None), 0), slots, pos[:, 0]
    b, t = np.nonzero(valid)
    return (b, t), slots[b], pos[b, t]


def new_tokens(k, take):
    """Keys or values (B, H, T, D) of the tokens ``take`` (from ``valid_tokens``) selects."""
    return k.transpose(0, 2, 1, 3)[take]


# -- what a model sees: one forward pass, one layer ---------------------------------------------------

def causal_mask(xp, qpos, tk: int):
    """Which keys each query may not see: (B, 1, Tq, Tk), True where key j > qpos[b, i] -- or None
    when nothing is hidden (a batch that only decodes, each query at the newest cached key).

    qpos (B, Tq) is the position of each query and key j sits at position j, so each sequence has
    its own length and a batch of different lengths needs no shared offset. For one sequence whose
    Tq queries follow Tk - Tq cached keys this is the causal mask shifted by Tk - Tq.
    """
    if qpos.shape[-1] == 1 and int(qpos.min()) >= tk - 1:
        return None
    return (xp.arange(tk)[None, None, :] > xp.asarray(qpos)[:, :, None])[:, None]


class CacheStep:
    """One forward pass over ``cache``: rows ``slots`` get new tokens at positions ``pos`` (B, T),
    of which ``valid`` are real (the rest is padding). Holds what every layer shares: the rows'
    index, how many keys to read, the mask."""

    def __init__(self, cache, slots, pos, valid):
        self.cache, self.slots, self.pos, self.valid = cache, slots, pos, valid
        self.rows = cache.index(slots)
        self.where = cache.locate(slots, pos, valid)
        self.tk = int(pos[valid].max()) + 1  # keys needed: up to the furthest real query
        if not cache.bucketed:
            self.hidden = causal_mask(cache.be.xp, pos, self.tk)
            return
        # JAX: read up to the next power of two; the mask, made on the host, hides the rest
        self.tk = bucket(self.tk, cache.max_len)
        hidden = causal_mask(np, pos, self.tk)
        self.hidden = None if hidden is None else cache.be.from_host(hidden)

    def layer(self, i: int) -> LayerCache:
        return LayerCache(self, i)


class LayerCache:
    """Block ``layer``'s view of a ``CacheStep``: what ``minidist.nn.attention.self_attention`` uses."""

    __slots__ = ("step", "layer")

    def __init__(self, step: CacheStep, layer: int):
        self.step, self.layer = step, layer

    @property
    def hidden(self):
        return self.step.hidden

    def update(self, k, v):
        """Store the new keys and values k, v (B, H, T, D); return all of these rows' (B, H, Tk, D)."""
        s = self.step
        s.cache.write(self.layer, s.where, k, v)
        return s.cache.read(self.layer, s.rows, s.tk)
