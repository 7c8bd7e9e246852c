"""Ulysses attention: the context-parallel split swapped from the sequence to the heads and back.

Ring attention keeps each rank on its own tokens and passes every other rank's K/V round. Ulysses
(DeepSpeed-Ulysses, Jacobs et al. 2023; Megatron's a2a context parallelism; MaxText ``ulysses``)
moves the split instead. Each of the cp ranks holds T/cp tokens of all H heads; attention needs all
tokens of a head, and different heads never meet, so:

1. an **all-to-all** of the fused projections q|k|v: rank r sends head group j (H/cp heads) of its
   tokens to rank j and receives head group r of everyone's tokens -- now it holds the *whole
   sequence* of H/cp heads;
2. plain attention over the full sequence on those heads (``blocks.block_attention``: one block,
   the tokens' global positions for the causal mask, so any ``layout`` of the tokens works);
3. a second **all-to-all** of the output sends each rank its tokens back, with every head.

Backward is the same three steps on the gradients (the output gradient in, dQ|dK|dV out). Each
all-to-all sends (cp-1)/cp of what it moves, so with N = B·(T/cp)·H·D elements of q per rank:
forward 3N + N, backward N + 3N, times (cp-1)/cp (:func:`ulysses_bytes`) -- it falls as cp grows,
where the ring's 2(cp-1)·N forward stays near 2·B·T·H·D. The price: cp can be at most the number of
heads (of this rank: H/tp under tensor parallelism), and must divide it (:func:`check_heads`).

**Hybrid** (USP, Fang and Zhao 2024): cp = u·R ranks as R groups of u. Ulysses inside a group (the
all-to-all over u ranks: the group's tokens, H/u heads), then a ring *across* the groups passes
each group's K/V block round (:func:`usp_groups`, :class:`PackedUSPAttention`): u is bounded by
the heads, R is not. Bytes: Ulysses' over u plus the ring's over R of the group's block.
"""

from __future__ import annotations

import math

import numpy as np

from minidist.accel.backend import backend_of
from minidist.autograd import ops
from minidist.autograd.tensor import Function
from minidist.comm import all_to_all
from minidist.nn.attention import merge_heads
from minidist.parallel.context.blocks import (
    block_attention,
    block_attention_grads,
    merge_attention,
    softmax_correction,
)
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


# -- hybrid: Ulysses inside groups of u ranks, a ring across the groups ----------------------------------

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
