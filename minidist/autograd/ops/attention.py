"""Attention as one op: softmax(q·kᵀ/√d + causal mask)·v, on separate q, k, v or on packed qkv.

``attention_probs`` and ``attention_grads`` are the forward and backward formulas both ops share
(and the tensor- and context-parallel attentions reuse); ``_heads``, ``merge_heads``, ``split_heads``
and ``pack_heads`` move between the projections' (B, T, H·D) layout and the heads' (B, H, T, D).
"""

from __future__ import annotations

import math

from minidist.autograd.ops.arrays import _xp
from minidist.autograd.ops.norms import _softmax
from minidist.autograd.tensor import Function


def causal_hidden(q, k):
    """The scores a causal mask hides: with ``q`` shorter than ``k`` (decoding with a KV cache)
    query i sits at key position Tk - Tq + i and sees keys up to and including it."""
    xp, tq, tk = _xp(q), q.shape[-2], k.shape[-2]
    return xp.arange(tk)[None, :] > (xp.arange(tq)[:, None] + (tk - tq))


def attention_probs(q, k, causal):
    """p = softmax(q·kᵀ/√d + causal mask) over the keys."""
    xp = _xp(q)
    s = (q @ xp.swapaxes(k, -1, -2)) * q.dtype.type(1.0 / math.sqrt(q.shape[-1]))
    if causal and k.shape[-2] > 1:
        s = xp.where(causal_hidden(q, k), xp.asarray(-xp.inf, dtype=s.dtype), s)
    return _softmax(s, -1)


def attention_grads(q, k, v, p, g):
    """(dq, dk, dv) of y = p·v, for the gradient g of y: dv = pᵀ·g; dp = g·vᵀ; the scores' gradient
    ds = p ⊙ (dp - Σ_j p·dp) (softmax's backward), over √d: dq = ds·k, dk = dsᵀ·q."""
    xp = _xp(g)
    dp = g @ xp.swapaxes(v, -1, -2)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True)) * q.dtype.type(1.0 / math.sqrt(q.shape[-1]))
    return ds @ k, xp.swapaxes(ds, -1, -2) @ q, xp.swapaxes(p, -1, -2) @ g


class ScaledDotProductAttention(Function):
    """softmax(q·kᵀ/√d + causal mask)·v over (batch, heads, time, head_dim) as one op.

    ``q`` may be shorter than ``k``/``v`` (decoding with a KV cache): query i sits at key position
    ``Tk - Tq + i`` and sees keys up to and including it.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal=True):
        p = attention_probs(q, k, causal)
        ctx.save(q, k, v, p)
        return p @ v

    @staticmethod
    def backward(ctx, g):
        q, k, v, p = ctx.saved
        return attention_grads(q, k, v, p, g)


def _heads(qkv, n_head):
    """q, k, v as (B, H, T, D) strided views of the fused projections qkv (B, T, 3·H·D): no copy,
    and BLAS multiplies such views in place (each (T, D) matrix has unit stride along D)."""
    b, t, three_c = qkv.shape
    parts = qkv.reshape(b, t, 3, n_head, three_c // (3 * n_head))
    return tuple(_xp(qkv).moveaxis(parts[:, :, i], 2, 1) for i in range(3))


def merge_heads(y):
    """(B, H, T, D) -> (B, T, H·D)."""
    return _xp(y).moveaxis(y, 1, 2).reshape(y.shape[0], y.shape[2], -1)


def split_heads(g, n_head):
    """(B, T, H·D) -> (B, H, T, D) (a view)."""
    b, t, c = g.shape
    return _xp(g).moveaxis(g.reshape(b, t, n_head, c // n_head), 2, 1)


def pack_heads(dq, dk, dv):
    """Three (B, H, T, D) gradients as one (B, T, 3·H·D), qkv's layout: stacked as (B, T, 3, H, D)."""
    xp, (b, _, t, _) = _xp(dq), dq.shape
    return xp.stack([xp.moveaxis(a, 1, 2) for a in (dq, dk, dv)], axis=2).reshape(b, t, -1)


class PackedAttention(Function):
    """Self-attention (causal by default) of the fused projections qkv (B, T, 3·H·D) to (B, T, H·D):
    the heads are split and merged inside the op (flash-attn's "qkvpacked" form), with the math of
    ``ScaledDotProductAttention``.

    Why one op: split into q, k, v by three indexing ops, qkv's gradient would be three zero-filled
    (B, T, 3·H·D) arrays, each with one third written, added up, then copied back from the heads'
    layout. Here backward stacks dq, dk, dv into one array, once.
    """

    @staticmethod
    def forward(ctx, qkv, n_head, causal=True):
        q, k, v = _heads(qkv, n_head)
        p = attention_probs(q, k, causal)
        ctx.save(qkv, p)
        ctx.n_head = n_head
        return merge_heads(p @ v)

    @staticmethod
    def backward(ctx, g):
        qkv, p = ctx.saved
        return pack_heads(*attention_grads(*_heads(qkv, ctx.n_head), p, split_heads(g, ctx.n_head)))


def check_packed(qkv, n_head: int, what: str) -> None:
    """qkv must be (batch, time, 3·n_head·head_dim): the fused projections an attention unpacks."""
    if len(qkv.shape) != 3 or n_head < 1 or qkv.shape[-1] % (3 * n_head):
        raise ValueError(f"{what}: qkv of shape {tuple(qkv.shape)} with n_head={n_head}: need "
                         f"(batch, time, 3·n_head·head_dim), the last axis a multiple of 3·n_head")
