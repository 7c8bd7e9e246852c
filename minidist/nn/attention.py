"""Causal multi-head self-attention, for training and for KV-cached decoding alike.

x (B, T, C) -> qkv = x @ W_qkv (B, T, 3C) -> q, k, v as (B, H, T, C/H) -> causal
scaled-dot-product attention -> merge heads (B, T, C) -> output projection -> dropout.

``self_attention(qkv, n_head, cache)`` is the middle part, shared by this layer and the
tensor-parallel one (``minidist.parallel.tensor.layers.ParallelAttention``, its heads split across
ranks). Without a cache it is one fused, differentiable op, ``ops.packed_attention``: the heads are
split and merged inside it, so backward writes qkv's gradient once (``split_heads`` and
``merge_heads`` are the same layout changes, for code that attends over other q, k, v).
With a cache (``minidist.infer``: one layer's view of a KV cache, inference only, under
``no_grad``) the new keys and values are stored, the queries attend to every cached key of their
own sequence, and ``cache.hidden`` masks the rest: each query sees the keys at positions up to
its own, which with Tq queries after Tk - Tq cached keys is the causal mask shifted by Tk - Tq.
"""

from __future__ import annotations

import math

import numpy as np

from minidist.accel import jax_engine
from minidist.accel.backend import backend_of
from minidist.autograd import ops
from minidist.autograd.tensor import Context, Tensor, grad_enabled
from minidist.nn.layers import Dropout, Linear
from minidist.nn.module import Module


def split_heads(qkv, n_head):
    """(B, T, 3·H·D) -> three tensors (B, H, T, D)."""
    b, t, three_c = qkv.shape
    d = three_c // (3 * n_head)
    qkv = qkv.reshape(b, t, 3, n_head, d).transpose(2, 0, 3, 1, 4)
    return qkv[0], qkv[1], qkv[2]


def merge_heads(y):
    """(B, H, T, D) -> (B, T, H·D)."""
    b, h, t, d = y.shape
    return y.transpose(0, 2, 1, 3).reshape(b, t, h * d)


def self_attention(qkv, n_head: int, cache=None):
    """Causal attention of the fused projections qkv (B, T, 3·H·D) over H heads: (B, T, H·D).

    ``cache``: a KV cache's view for this layer (``update(k, v) -> all keys, values`` of these
    sequences, (B, H, Tk, D), and ``hidden``, (B, 1, T, Tk) True where a key is not visible, or None).
    """
    if cache is None:
        return ops.packed_attention(qkv, n_head, causal=True)
    if grad_enabled() and qkv.requires_grad:
        raise RuntimeError("self_attention: a KV cache is for inference; run it under "
                           "minidist.autograd.tensor.no_grad()")
    q, k, v = split_heads(qkv.data, n_head)  # arrays: nothing is recorded
    keys, values = cache.update(k, v)
    return Tensor(merge_heads(masked_attention(q, keys, values, cache.hidden)))


@jax_engine.pure  # on JAX one compiled call per shape, not ~8 (the KV cache's bucketed reads)
def masked_attention(q, k, v, hidden=None):
    """softmax(q·kᵀ/√D, hidden keys at -inf)·v on arrays (no graph): q (B, H, Tq, D), k and v
    (B, H, Tk, D), ``hidden`` broadcastable to (B, H, Tq, Tk) or None (every key visible)."""
    xp = backend_of(q).xp
    s = (q @ xp.swapaxes(k, -1, -2)) * q.dtype.type(1.0 / math.sqrt(q.shape[-1]))
    if hidden is not None:
        s = xp.where(hidden, xp.asarray(-xp.inf, dtype=s.dtype), s)
    return ops.Softmax.forward(Context((False,), record=False), s, -1) @ v


class CausalSelfAttention(Module):
    def __init__(self, dim, n_head, dropout=0.0, *, dtype=np.float32, std=0.02, proj_std=None, rng=None,
                 backend=None):
        super().__init__()
        if dim % n_head:
            raise ValueError(f"d_model {dim} is not divisible by n_head {n_head}")
        self.n_head = n_head
        self.qkv = Linear(dim, 3 * dim, dtype=dtype, std=std, rng=rng, backend=backend)
        self.proj = Linear(dim, dim, dtype=dtype, std=proj_std or std, rng=rng, backend=backend)
        self.drop = Dropout(dropout)

    def forward(self, x, cache=None):
        return self.drop(self.proj(self_attention(self.qkv(x), self.n_head, cache)))
