"""Attention of one block of queries over one block of keys, the online-softmax merge, and the backward.

Ring attention never sees all keys at once: each step gives a *partial* attention, softmax over
one block's keys. Partial results merge exactly if each carries its log-sum-exp
``lse = log Σ_j exp(s_j)`` over the keys it saw (FlashAttention's rule, :func:`merge_attention`):

    lse = log(e^{lse_a} + e^{lse_b}),   out = e^{lse_a - lse}·out_a + e^{lse_b - lse}·out_b

Backward recomputes the final softmax from the saved lse, ``P = exp(s - lse)``, and needs one
correction per query, ``delta = rowsum(dO ∘ O)`` (:func:`softmax_correction`), so a block's
gradients (:func:`block_attention_grads`) need only that block: dS = P ∘ (dO·Vᵀ - delta).

Arrays are (..., T, D) queries/keys/values and (..., T) lse, of any array library.
"""

from __future__ import annotations

import numpy as np

from minidist.accel.backend import backend_of


def _scores(q, k, q_pos, k_pos, scale, causal):
    """q·kᵀ·scale, a key after its query at -inf when ``causal``."""
    xp = backend_of(q).xp
    s = (q @ xp.swapaxes(k, -1, -2)) * q.dtype.type(scale)
    if causal:
        s = xp.where(xp.asarray(k_pos[None, :] > q_pos[:, None]), xp.asarray(-xp.inf, dtype=s.dtype), s)
    return s


def block_attention(q, k, v, q_pos, k_pos, scale, causal=True):
    """softmax(q·kᵀ·scale, keys after a query hidden)·v and its lse, for one block pair; a query
    that sees no key gets out 0 and lse -inf."""
    xp = backend_of(q).xp
    s = _scores(q, k, q_pos, k_pos, scale, causal)
    m = s.max(axis=-1, keepdims=True)
    m = xp.where(xp.isfinite(m), m, 0.0)
    e = xp.exp(s - m)
    total = e.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = (xp.log(total) + m)[..., 0]
    return (e / xp.where(total > 0, total, 1.0)) @ v, lse


def merge_attention(out_a, lse_a, out_b, lse_b):
    """The online-softmax merge: two attentions of the same queries over disjoint key sets ->
    the attention over their union. out (..., T, D), lse (..., T) = log Σ exp(scores) of each set
    (-inf: no key seen). Returns (out, lse)."""
    xp = backend_of(out_a).xp
    lse = xp.logaddexp(lse_a, lse_b)
    safe = xp.where(xp.isfinite(lse), lse, 0.0)  # rows that saw no key stay 0 with lse -inf
    wa = xp.where(xp.isfinite(lse_a), xp.exp(lse_a - safe), 0.0)
    wb = xp.where(xp.isfinite(lse_b), xp.exp(lse_b - safe), 0.0)
    return wa[..., None] * out_a + wb[..., None] * out_b, lse


def softmax_correction(g, out):
    """delta = rowsum(dO ∘ O) per query, (..., T): what the softmax backward subtracts."""
    return (g * out).sum(axis=-1)


def block_attention_grads(q, k, v, g, lse, delta, q_pos, k_pos, scale, causal=True):
    """One block pair's share of (dq, dk, dv), given the output gradient ``g`` and the *final* lse
    and delta of these queries (over every key, not only this block's)."""
    xp = backend_of(q).xp
    p = xp.exp(_scores(q, k, q_pos, k_pos, scale, causal) - lse[..., None])  # the final softmax
    dv = xp.swapaxes(p, -1, -2) @ g
    ds = p * (g @ xp.swapaxes(v, -1, -2) - delta[..., None]) * q.dtype.type(scale)
    return ds @ k, xp.swapaxes(ds, -1, -2) @ q, dv
