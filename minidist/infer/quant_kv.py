"""The int8 KV cache: keys and values stored as int8 with one scale per token and head.

Each cached vector x (one token, one head) is kept as

    scale = max_i |x_i| / 127        q_i = round(x_i / scale)  in [-127, 127]   (int8)
    x̂_i  = q_i · scale               |x̂_i - x_i| <= scale / 2 = max|x| / 254

so an outlier coarsens only its own token and head; a token costs 2 · n_layer · kv_heads ·
(head_dim + 4) bytes against 4 · head_dim in float32. Attention reads x̂ in the model's dtype.
``Int8KVCache``, ``Int8PagedKVCache`` and ``Int8PrefixCachingKVCache`` are the caches they are named
after with ``Int8Storage`` mixed in: it stores through the caches' own ``put`` and reads through
their own ``take`` -- the values and, beside them, the scales -- then dequantizes. Chapter 9.
"""

from __future__ import annotations

import numpy as np

from minidist.accel import compiled
from minidist.accel.backend import backend_of
from minidist.infer.kv_cache import KVCache
from minidist.infer.paged import PagedKVCache
from minidist.infer.prefix_cache import PrefixCachingKVCache

SCALE_DTYPE = np.float32


@compiled.pure
def quantize(x):
    """x (..., D) -> (int8 q (..., D), float32 scale (..., 1)) with x ≈ q · scale, per vector."""
    xp = backend_of(x).xp
    scale = (xp.abs(x).max(axis=-1, keepdims=True) / 127).astype(SCALE_DTYPE)
    safe = xp.where(scale > 0, scale, xp.ones_like(scale))  # an all-zero vector: q = 0, scale = 0
    q = xp.clip(xp.rint(x / safe.astype(x.dtype)), -127, 127).astype(np.int8)
    return q, scale


@compiled.pure
def dequantize(q, scale, dtype):
    """q · scale in ``dtype``."""
    return q.astype(dtype) * scale.astype(dtype)


class Int8Storage:
    """Mixed in before a cache class: int8 ``k``, ``v`` and float32 ``k_scale``, ``v_scale``."""

    def allocate(self, n_layer, shape, dtype, backend):
        super().allocate(n_layer, shape, np.int8, backend)
        self.dtype = np.dtype(dtype)  # what attention gets back
        scale_shape = tuple(shape[:-1]) + (1,)
        self.k_scale = [self.be.xp.zeros(scale_shape, dtype=SCALE_DTYPE) for _ in range(n_layer)]
        self.v_scale = [self.be.xp.zeros(scale_shape, dtype=SCALE_DTYPE) for _ in range(n_layer)]

    def write(self, layer, where, k, v):
        (qk, sk), (qv, sv) = quantize(k), quantize(v)
        self.k[layer], self.v[layer] = self.put(self.k[layer], self.v[layer], where, qk, qv)
        self.k_scale[layer], self.v_scale[layer] = self.put(self.k_scale[layer], self.v_scale[layer],
                                                            where, sk, sv)

    def read(self, layer, rows, tk):
        qk, qv = self.take(self.k[layer], self.v[layer], rows, tk)
        sk, sv = self.take(self.k_scale[layer], self.v_scale[layer], rows, tk)
        return dequantize(qk, sk, self.dtype), dequantize(qv, sv, self.dtype)

    def arrays(self) -> list:
        return [*self.k, *self.v, *self.k_scale, *self.v_scale]


def int8_bytes_per_token(n_layer: int, kv_heads: int, head_dim: int) -> int:
    """The formula: 2 (k, v) · layers · K/V heads · (head_dim int8 values + a float32 scale)."""
    return 2 * n_layer * kv_heads * (head_dim + np.dtype(SCALE_DTYPE).itemsize)


class Int8KVCache(Int8Storage, KVCache):
    """``KVCache`` with int8 keys and values."""


class Int8PagedKVCache(Int8Storage, PagedKVCache):
    """``PagedKVCache`` with int8 keys and values."""


class Int8PrefixCachingKVCache(Int8Storage, PrefixCachingKVCache):
    """``PrefixCachingKVCache`` with int8 keys and values."""
