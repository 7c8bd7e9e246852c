"""Causal self-attention -- multi-head, grouped-query or multi-query -- for training and decoding.

x (B, T, C) -> qkv = x @ W_qkv (B, T, (H + 2·K)·D) -> q (B, H, T, D), k and v (B, K, T, D) -> causal
attention -> merge heads (B, T, H·D) -> output projection -> dropout. K = ``n_kv_head`` key/value
heads serve the H query heads (query head h uses K/V head ``h // (H / K)``; K = H by default).
``self_attention``, the middle part, is shared with the tensor-parallel layers: one fused op, or with
a KV cache (inference) a read of every visible cached key. lessons/01-train.md walks through both.
"""

from __future__ import annotations

import math

import numpy as np

from minidist.accel import compiled
from minidist.accel.backend import backend_of
from minidist.autograd import ops
from minidist.autograd.tensor import Context, Function, Tensor, grad_enabled
from minidist.nn.layers import Dropout, Linear
from minidist.nn.module import Module


def check_heads(d_model: int, n_head: int, n_kv_head: int | None, what: str = "attention") -> int:
    """The number of K/V heads (``n_head`` when None), or a ValueError saying what would divide."""
    if d_model % n_head:
        raise ValueError(f"{what}: d_model {d_model} is not divisible by n_head {n_head}")
    k = n_head if n_kv_head is None else n_kv_head
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1 or n_head % k:
        ok = [d for d in range(1, n_head + 1) if n_head % d == 0]
        raise ValueError(f"{what}: n_kv_head must be a positive divisor of n_head {n_head} (each K/V head "
                         f"serves n_head / n_kv_head query heads), one of {ok}; got {n_kv_head!r}")
    return int(k)


def split_heads(qkv, n_head, n_kv_head=None):
    """(B, T, (H + 2·K)·D) -> q (B, H, T, D), k and v (B, K, T, D); K = ``n_kv_head`` (default H)."""
    b, t, width = qkv.shape
    k_heads = n_head if n_kv_head is None else n_kv_head
    if width % (n_head + 2 * k_heads):
        raise ValueError(f"split_heads: qkv width {width} is not (n_head + 2·n_kv_head)·head_dim for "
                         f"n_head={n_head}, n_kv_head={k_heads}")
    d = width // (n_head + 2 * k_heads)
    if k_heads == n_head:
        qkv = qkv.reshape(b, t, 3, n_head, d).transpose(2, 0, 3, 1, 4)
        return qkv[0], qkv[1], qkv[2]
    q = qkv[..., :n_head * d].reshape(b, t, n_head, d).transpose(0, 2, 1, 3)
    kv = qkv[..., n_head * d:].reshape(b, t, 2, k_heads, d).transpose(2, 0, 3, 1, 4)
    return q, kv[0], kv[1]


def merge_heads(y):
    """(B, H, T, D) -> (B, T, H·D)."""
    b, h, t, d = y.shape
    return y.transpose(0, 2, 1, 3).reshape(b, t, h * d)


def group(q, k, v, kv_of=None):
    """q (B, H, T, D) and k, v (B, K, Tk, D) laid out so that plain broadcasting attention pairs each
    query head with its K/V head: q (B, K, H/K, T, D) against k, v (B, K, 1, Tk, D) -- no copy of
    the keys -- or, for an explicit ``kv_of``, k and v gathered to (B, H, Tk, D)."""
    if kv_of is not None:
        idx = np.asarray(kv_of, dtype=np.int64)
        return q, k[:, idx], v[:, idx]
    b, h, t, d = q.shape
    kh = k.shape[1]
    return q.reshape(b, kh, h // kh, t, d), k[:, :, None], v[:, :, None]


def ungroup(dk, n_kv_head: int, kv_of=None):
    """The gradient of each K/V head (B, K, Tk, D) from the grouped layout's: the sum over its queries."""
    if kv_of is None:
        return dk.sum(axis=2)
    xp = backend_of(dk).xp
    onehot = xp.asarray(np.eye(n_kv_head, dtype=dk.dtype)[np.asarray(kv_of, dtype=np.int64)])  # (H, K)
    return xp.einsum("bhtd,hk->bktd", dk, onehot)


class GroupedAttention(Function):
    """Causal self-attention of the fused projections qkv (B, T, (H + 2·K)·D) to (B, T, H·D), query
    head h attending with K/V head h // (H/K) (or ``kv_of[h]``): forward and backward fused, as
    ``ops.PackedAttention`` for K = H."""

    @staticmethod
    def forward(ctx, qkv, n_head, n_kv_head, kv_of=None):
        q, k, v = group(*split_heads(qkv, n_head, n_kv_head), kv_of)
        p = ops.attention_probs(q, k, True)
        ctx.save(qkv, p)
        ctx.n_head, ctx.n_kv_head, ctx.kv_of = n_head, n_kv_head, kv_of
        y = p @ v
        return merge_heads(y.reshape(qkv.shape[0], n_head, *y.shape[-2:]))

    @staticmethod
    def backward(ctx, g):
        qkv, p = ctx.saved
        q, k, v = group(*split_heads(qkv, ctx.n_head, ctx.n_kv_head), ctx.kv_of)
        b, t, c = g.shape
        gh = g.reshape(b, t, ctx.n_head, c // ctx.n_head).transpose(0, 2, 1, 3).reshape(q.shape)
        dq, dk, dv = ops.attention_grads(q, k, v, p, gh)
        dq = dq.reshape(b, ctx.n_head, t, -1)
        dk, dv = (ungroup(a, ctx.n_kv_head, ctx.kv_of) for a in (dk, dv))
        return backend_of(g).xp.concatenate([merge_heads(a) for a in (dq, dk, dv)], axis=-1)


def self_attention(qkv, n_head: int, cache=None, n_kv_head: int | None = None, kv_of=None):
    """Causal attention of the fused projections qkv (B, T, (H + 2·K)·D) over H query heads and
    K = ``n_kv_head`` (default H) K/V heads: (B, T, H·D).

    ``cache``: a KV cache's view for this layer (``update(k, v) -> all keys, values`` of these
    sequences, (B, K, Tk, D), and ``hidden``, (B, 1, T, Tk) True where a key is not visible, or None).
    """
    k_heads = n_head if n_kv_head is None else n_kv_head
    grouped = k_heads != n_head or kv_of is not None
    if cache is None:
        if not grouped:
            return ops.packed_attention(qkv, n_head, causal=True)
        return GroupedAttention.apply(qkv, n_head=n_head, n_kv_head=k_heads, kv_of=kv_of)
    if grad_enabled() and qkv.requires_grad:
        raise RuntimeError("self_attention: a KV cache is for inference; run it under "
                           "minidist.autograd.tensor.no_grad()")
    q, k, v = split_heads(qkv.data, n_head, k_heads)  # arrays: nothing is recorded
    keys, values = cache.update(k, v)
    if not grouped:
        return Tensor(merge_heads(masked_attention(q, keys, values, cache.hidden)))
    return Tensor(merge_heads(grouped_masked_attention(q, keys, values, cache.hidden, kv_of)))


@compiled.pure  # on JAX one compiled call per shape, not ~8 (the KV cache's bucketed reads)
def masked_attention(q, k, v, hidden=None):
    """softmax(q·kᵀ/√D, hidden keys at -inf)·v on arrays (no graph): q (B, H, Tq, D), k and v
    (B, H, Tk, D), ``hidden`` broadcastable to (B, H, Tq, Tk) or None (every key visible)."""
    xp = backend_of(q).xp
    s = (q @ xp.swapaxes(k, -1, -2)) * q.dtype.type(1.0 / math.sqrt(q.shape[-1]))
    if hidden is not None:
        s = xp.where(hidden, xp.asarray(-xp.inf, dtype=s.dtype), s)
    return ops.Softmax.forward(Context((False,), record=False), s, -1) @ v


@compiled.pure
def grouped_masked_attention(q, k, v, hidden=None, kv_of=None):
    """``masked_attention`` of H query heads (B, H, Tq, D) over K K/V heads (B, K, Tk, D)."""
    qg, kg, vg = group(q, k, v, kv_of)
    if hidden is not None and kv_of is None:
        hidden = hidden[:, :, None]  # (B, 1, 1, Tq, Tk): the same mask for every head of a group
    return masked_attention(qg, kg, vg, hidden).reshape(q.shape)


class CausalSelfAttention(Module):
    """H query heads, ``n_kv_head`` K/V heads (default H): qkv = Linear(C, (H + 2·K)·C/H)."""

    def __init__(self, dim, n_head, dropout=0.0, *, dtype=np.float32, std=0.02, proj_std=None, rng=None,
                 backend=None, n_kv_head=None):
        super().__init__()
        self.n_head = n_head
        self.n_kv_head = check_heads(dim, n_head, n_kv_head, "CausalSelfAttention")
        width = dim + 2 * self.n_kv_head * (dim // n_head)
        self.qkv = Linear(dim, width, dtype=dtype, std=std, rng=rng, backend=backend)
        self.proj = Linear(dim, dim, dtype=dtype, std=proj_std or std, rng=rng, backend=backend)
        self.drop = Dropout(dropout)

    def forward(self, x, cache=None):
        return self.drop(self.proj(self_attention(self.qkv(x), self.n_head, cache, self.n_kv_head)))
