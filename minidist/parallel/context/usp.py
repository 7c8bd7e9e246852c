"""Hybrid context parallelism (USP, Fang and Zhao 2024): Ulysses inside groups, a ring across them.

cp = u·R ranks as R groups of u. Ulysses inside a group (the all-to-all over u ranks: the group's
tokens, H/u heads), then a ring *across* the groups passes each group's K/V block round, merged by
the online softmax (:class:`PackedUSPAttention`): u is bounded by the heads, R is not. Bytes:
Ulysses' over u plus the ring's over R of the group's block (:func:`usp_bytes`).
"""

from __future__ import annotations

import math

import numpy as np

from minidist.accel.backend import backend_of
from minidist.autograd import ops
from minidist.autograd.tensor import Function
from minidist.nn.attention import merge_heads
from minidist.parallel.context.blocks import (
    block_attention,
    block_attention_grads,
    merge_attention,
    softmax_correction,
)
from minidist.parallel.context.layout import chunk_positions
from minidist.parallel.context.ulysses import _to_heads, _to_tokens, check_heads, ulysses_bytes


def usp_groups(cp, u: int):
    """(the Ulysses group of cp ranks g·u .. g·u+u-1, the ring of ranks with the same place in their
    group): collective over ``cp``; u must divide cp."""
    if u < 1 or cp.size % u:
        ok = [d for d in range(1, cp.size + 1) if cp.size % d == 0]
        raise ValueError(f"rank {cp.rank}: hybrid context parallelism groups the cp = {cp.size} ranks by "
                         f"ulysses_size = {u}; it must divide cp (one of {ok})")
    return cp.split(cp.rank // u, cp.rank), cp.split(cp.rank % u, cp.rank)


def _group_positions(t_total: int, cp: int, group: int, u: int, layout: str):
    """Global positions of group ``group``'s tokens as its all-to-all lays them out."""
    return np.concatenate([chunk_positions(t_total, cp, group * u + j, layout) for j in range(u)])


class PackedUSPAttention(Function):
    """Hybrid attention of qkv (B, T/cp, 3·H·D): all-to-all over ``uly`` (u ranks), K/V round ``ring``
    (R ranks, one per group), all-to-all back: (B, T/cp, H·D)."""

    @staticmethod
    def forward(ctx, qkv, uly, ring, heads, layout, causal=True):
        b, t, c = qkv.shape
        u, big_r, me, d = uly.size, ring.size, ring.rank, c // (3 * heads)
        hu = check_heads(heads, u, uly.rank)
        full = _to_heads(uly, qkv.reshape(b, t, 3, u, hu, d), 1)  # (B, u·t, 3, H/u, D): my group's tokens
        q, k, v = full.transpose(2, 0, 3, 1, 4)
        pos = [_group_positions(t * u * big_r, u * big_r, g, u, layout) for g in range(big_r)]
        scale = 1.0 / math.sqrt(d)
        kv, out, lse = backend_of(q).xp.stack([k, v]), None, None
        for s in range(big_r):  # group (me - s)'s K/V in hand
            o, l_ = block_attention(q, kv[0], kv[1], pos[me], pos[(me - s) % big_r], scale, causal)
            out, lse = (o, l_) if out is None else merge_attention(out, lse, o, l_)
            if s < big_r - 1:
                kv = ring.sendrecv(kv, (me + 1) % big_r, (me - 1) % big_r)
        ctx.save(q, k, v, out, lse)
        ctx.uly, ctx.ring, ctx.pos, ctx.scale, ctx.causal, ctx.hu = uly, ring, pos, scale, causal, hu
        return merge_heads(_to_tokens(uly, out, 2, 1).reshape(b, heads, t, d))

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, lse = ctx.saved
        uly, ring, pos = ctx.uly, ctx.ring, ctx.pos
        big_r, me = ring.size, ring.rank
        b, t, _ = g.shape
        d = q.shape[-1]
        xp = backend_of(q).xp
        gh = _to_heads(uly, g.reshape(b, t, uly.size, ctx.hu, d).transpose(0, 1, 3, 2, 4), 1)
        gh = gh.transpose(0, 2, 1, 3)                                    # (B, H/u, u·t, D)
        delta = softmax_correction(gh, out)
        kv, dq, dkv = xp.stack([k, v]), None, None
        for s in range(big_r):  # group src's K/V, and its dK, dV so far, travel together
            src = (me - s) % big_r
            a, dk, dv = block_attention_grads(q, kv[0], kv[1], gh, lse, delta, pos[me], pos[src], ctx.scale,
                                              ctx.causal)
            dq = a if dq is None else dq + a
            dkv = xp.stack([dk, dv]) if dkv is None else dkv + xp.stack([dk, dv])
            if big_r > 1:  # after R hops each block's dK, dV is home
                if s < big_r - 1:
                    kv = ring.sendrecv(kv, (me + 1) % big_r, (me - 1) % big_r)
                dkv = ring.sendrecv(dkv, (me + 1) % big_r, (me - 1) % big_r)
        dqkv = xp.stack([dq, dkv[0], dkv[1]]).transpose(1, 3, 0, 2, 4)   # (B, u·t, 3, H/u, D)
        return _to_tokens(uly, dqkv, 1, 3).reshape(b, t, 3 * uly.size * ctx.hu * d)


def packed_usp_attention(qkv, heads: int, groups, layout: str = "zigzag", causal: bool = True):
    """Hybrid attention of the fused projections (a Tensor (B, T/cp, 3·H·D)); ``groups``: ``usp_groups``."""
    uly, ring = groups
    ops.check_packed(qkv, heads, f"rank {uly.rank}: packed_usp_attention")
    return PackedUSPAttention.apply(qkv, uly=uly, ring=ring, heads=heads, layout=layout, causal=causal)


def usp_bytes(n_elements: int, itemsize: int, u: int, rings: int) -> dict:
    """Bytes one rank sends in hybrid attention: Ulysses' over u ranks, and the ring's over ``rings``
    groups of the group's K/V block (2·n_elements: u·T/cp tokens of H/u heads each)."""
    a2a = ulysses_bytes(n_elements, itemsize, u)
    kv = 2 * n_elements * itemsize
    return {"forward": a2a["forward"] + (rings - 1) * kv,
            "backward": a2a["backward"] + ((2 * rings - 1) * kv if rings > 1 else 0)}
