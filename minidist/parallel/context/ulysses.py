"""Ulysses attention: the context-parallel split swapped from the sequence to the heads and back.

Ring attention keeps each rank on its own tokens and passes every other rank's K/V round. Ulysses
(DeepSpeed-Ulysses, Jacobs et al. 2023) moves the split instead: each of the cp ranks holds T/cp
tokens of all H heads, and different heads never meet, so

1. an **all-to-all** of the fused q|k|v sends head group j (H/cp heads) of my tokens to rank j:
   each rank then holds the *whole sequence* of H/cp heads;
2. plain attention over the full sequence on those heads (``blocks.block_attention``, with the
   tokens' global positions for the causal mask, so any ``layout`` works);
3. a second **all-to-all** of the output sends each rank its tokens back, with every head.

Backward is the same three steps on the gradients. Bytes: :func:`ulysses_bytes` (chapter 14). cp
must divide the heads of a rank (:func:`check_heads`). The hybrid of Ulysses and the ring is
``usp.py``.
"""

from __future__ import annotations

import math

import numpy as np

from minidist.accel.backend import backend_of
from minidist.autograd import ops
from minidist.autograd.tensor import Function
from minidist.comm import all_to_all
from minidist.nn.attention import merge_heads
from minidist.parallel.context.blocks import block_attention, block_attention_grads, softmax_correction
from minidist.parallel.context.layout import chunk_positions


def check_heads(heads: int, cp: int, rank: int = 0) -> int:
    """Heads per rank after the all-to-all, H / cp, or a ValueError saying what would work."""
    if cp > heads or heads % cp:
        ok = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ValueError(f"rank {rank}: Ulysses attention splits the {heads} attention heads of a rank over "
                         f"cp = {cp} ranks; cp must divide them (cp in {ok}), or use mode='ring'")
    return heads // cp


def _positions(t_total: int, cp: int, layout: str):
    """Global positions of the whole sequence as the first all-to-all lays it out: rank 0's tokens,
    then rank 1's, ..."""
    return np.concatenate([chunk_positions(t_total, cp, r, layout) for r in range(cp)])


def _to_heads(comm, x, axis_t: int):
    """All-to-all: x (B, t, ..., cp, ...) with the head groups on axis ``axis_t + 2`` -> this rank's
    head group of every rank's tokens, concatenated along the token axis."""
    xp = backend_of(x).xp
    groups = [xp.ascontiguousarray(xp.take(x, j, axis=axis_t + 2)) for j in range(comm.size)]
    return xp.concatenate(all_to_all(comm, groups), axis=axis_t)


def _to_tokens(comm, x, axis_t: int, axis_h: int):
    """The inverse all-to-all: x with every rank's tokens along ``axis_t`` (rank order) -> this rank's
    tokens with every head group, stacked along ``axis_h``."""
    xp = backend_of(x).xp
    parts = [xp.ascontiguousarray(p) for p in xp.split(x, comm.size, axis=axis_t)]
    return xp.stack(all_to_all(comm, parts), axis=axis_h)


class PackedUlyssesAttention(Function):
    """Attention of the fused projections qkv (B, T/cp, 3·H·D) over ``heads`` heads, the sequence split
    over ``comm``: (B, T/cp, H·D), as ``ops.packed_attention`` of the whole sequence."""

    @staticmethod
    def forward(ctx, qkv, comm, heads, layout, causal=True):
        b, t, c = qkv.shape
        cp, d = comm.size, c // (3 * heads)
        hc = check_heads(heads, cp, comm.rank)
        full = _to_heads(comm, qkv.reshape(b, t, 3, cp, hc, d), 1)  # (B, T, 3, H/cp, D)
        q, k, v = full.transpose(2, 0, 3, 1, 4)                     # each (B, H/cp, T, D)
        pos = _positions(t * cp, cp, layout)
        scale = 1.0 / math.sqrt(d)
        out, lse = block_attention(q, k, v, pos, pos, scale, causal)
        ctx.save(q, k, v, out, lse)
        ctx.comm, ctx.pos, ctx.scale, ctx.causal, ctx.hc = comm, pos, scale, causal, hc
        mine = _to_tokens(comm, out, 2, 1)                          # (B, cp, H/cp, t, D)
        return merge_heads(mine.reshape(b, heads, t, d))

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, lse = ctx.saved
        comm, hc = ctx.comm, ctx.hc
        b, t, _ = g.shape
        d = q.shape[-1]
        gh = g.reshape(b, t, comm.size, hc, d).transpose(0, 1, 3, 2, 4)  # head groups on axis 3
        gh = _to_heads(comm, gh, 1).transpose(0, 2, 1, 3)               # (B, H/cp, T, D)
        delta = softmax_correction(gh, out)
        dq, dk, dv = block_attention_grads(q, k, v, gh, lse, delta, ctx.pos, ctx.pos, ctx.scale, ctx.causal)
        xp = backend_of(dq).xp
        dqkv = xp.stack([dq, dk, dv]).transpose(1, 3, 0, 2, 4)           # (B, T, 3, H/cp, D)
        mine = _to_tokens(comm, dqkv, 1, 3)                              # (B, t, 3, cp, H/cp, D)
        return mine.reshape(b, t, 3 * comm.size * hc * d)


def packed_ulysses_attention(qkv, heads: int, comm, layout: str = "zigzag", causal: bool = True):
    """Ulysses attention of the fused projections (a Tensor (B, T/cp, 3·H·D)): (B, T/cp, H·D)."""
    ops.check_packed(qkv, heads, f"rank {comm.rank}: packed_ulysses_attention")
    check_heads(heads, comm.size, comm.rank)
    return PackedUlyssesAttention.apply(qkv, comm=comm, heads=heads, layout=layout, causal=causal)


def ulysses_bytes(n_elements: int, itemsize: int, cp: int) -> dict:
    """Bytes one rank sends, ``n_elements`` = B·(T/cp)·H·D (its q): the all-to-alls of q|k|v and of the
    output forward, of the output gradient and dQ|dK|dV backward, each (cp-1)/cp of what it moves."""
    each = (cp - 1) * (n_elements // cp) * itemsize
    return {"forward": 4 * each, "backward": 4 * each}
