"""Ring attention: the sequence split over a ``cp`` group, attention by passing K/V round a ring.

Each of the cp ranks holds T/cp tokens (``layout``: two of 2·cp chunks, zig-zag for causal load
balance); attention needs every earlier key, so **ring attention** (Liu et al. 2023) passes them
round. At step s rank r holds the K/V block of rank (r - s) mod cp, and:

1. starts sending that block on to r + 1 (and receiving the next from r - 1): ``_Hop``;
2. computes its queries' attention over the block, chunk pair by chunk pair, merged into the
   running (out, lse) by the online softmax (``attend_block``, from ``blocks.py``);
3. waits for the transfer, which hid behind the compute, and swaps blocks.

Backward rings again, each block travelling with its dK, dV so far; after cp hops they are home.
On JAX every array-only function here is one compiled call (``compiled.pure``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from minidist.accel import compiled
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
from minidist.parallel.context.layout import (  # noqa: F401  (also importable from here)
    LAYOUTS,
    check_sequence,
    chunk_ids,
    chunk_pairs,
    chunk_positions,
    halves,
    shard_sequence,
    unshard_sequence,
)
from minidist.trace.spans import current, span

# -- the rings --------------------------------------------------------------------------------------

class _Hop:
    """A block's move one step round the ring (to rank r+1; rank r-1's arrives), started before the
    compute it overlaps; recorded as a transfer ``what`` on the timeline when tracing."""

    def __init__(self, ring, x, tag: int, what: str):
        if isinstance(x, tuple):  # this rank's own (k, v): one message, stacked on the host
            x = np.stack([backend_of(a).to_host(a) for a in x])
        self.tracer, self.what = current(), what
        self.t0 = self.tracer.now() if self.tracer is not None else 0.0
        self.recv = ring.irecv((ring.rank - 1) % ring.size, tag=tag)
        self.send = ring.isend(x, (ring.rank + 1) % ring.size, tag=tag)

    def wait(self):
        """The previous rank's block, once it is here and ours has left."""
        self.send.wait()
        x = self.recv.wait()
        if self.tracer is not None:
            self.tracer.add(self.what, "send", self.t0, self.tracer.now())
        return x


def _computing(letter: str, src: int, pairs: tuple, q, stats):
    """The one hook on a step's compute: span 'F<src>' / 'B<src>' on the timeline (nothing when
    not tracing), and its chunk pairs and FLOPs counted into ``stats``."""
    if stats is not None:
        stats.count(letter == "B", len(pairs), q.shape)
    return span(letter, "compute", mb=src)


def ring_forward(comm, q, kv, pairs_with, stats=None):
    """This rank's queries ``q`` over every rank's K/V block, its own ``kv`` first.
    ``pairs_with(src)``: the chunk pairs to compute with rank src's block. Returns (out, lse) of
    the two query chunks."""
    ring, r, p = comm.channel("ring_attention"), comm.rank, comm.size
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = lse = (None, None)
    for s in range(p):
        src = (r - s) % p                                      # whose block is in hand
        hop = _Hop(ring, kv, 0, "K/V") if s < p - 1 else None  # on its way while we compute
        pairs = pairs_with(src)
        with _computing("F", src, pairs, q, stats):
            out, lse = attend_block(q, kv, out, lse, pairs, scale)
        if hop is not None:
            kv = hop.wait()
    return out, lse


def ring_backward(comm, q, kv, g, lse, delta, pairs_with, stats=None):
    """The backward ring: K/V travel round again, each block's dK, dV with it. Returns (dQ of the
    two query chunks, the dK/dV (2, B, H, T/cp, D) of this rank's own block)."""
    ring, r, p = comm.channel("ring_attention"), comm.rank, comm.size
    scale = 1.0 / math.sqrt(q.shape[-1])
    dq, dkv = (None, None), None
    for s in range(p):
        src = (r - s) % p
        hop = _Hop(ring, kv, 1, "K/V") if s < p - 1 else None
        pairs = pairs_with(src)
        with _computing("B", src, pairs, q, stats):
            dq, dkv = attend_block_backward(q, kv, g, lse, delta, dq, dkv, pairs, scale)
        if hop is not None:
            kv = hop.wait()
        if p > 1:  # block src's dK, dV go on with it (home to its owner after the last hop)
            dkv = _Hop(ring, dkv, 2, "dK/dV").wait()
    return dq, dkv


# -- one ring step's compute ------------------------------------------------------------------------

def _plus(total, part):
    return part if total is None else total + part


@compiled.pure
def attend_block(q, kv, out, lse, pairs, scale):
    """One forward step: queries ``q`` (B, H, T/cp, D) over the K/V block in hand ``kv``
    (2, B, H, T/cp, D), or the pair (k, v). Each visible chunk pair (i, j, diagonal) is one block
    attention, merged into query chunk i's running result; ``out``, ``lse``: the two query chunks'
    (None: no key yet)."""
    qs, ks, vs = halves(q), halves(kv[0]), halves(kv[1])
    out, lse = list(out), list(lse)
    for i, j, diagonal in pairs:
        pos = backend_of(q).xp.arange(qs[i].shape[-2])  # positions within a chunk; chunks are whole
        o, l_ = block_attention(qs[i], ks[j], vs[j], pos, pos, scale, diagonal)
        out[i], lse[i] = (o, l_) if out[i] is None else merge_attention(out[i], lse[i], o, l_)
    return out, lse


@compiled.pure
def attend_block_backward(q, kv, g, lse, delta, dq, dkv, pairs, scale):
    """One backward step: each visible chunk pair's share of dQ (``dq``: the two query chunks', None
    before any) and of the block's dK, dV (``dkv`` (2, B, H, T/cp, D): what the ranks before added,
    None on its owner). Returns (dq, dkv): dkv is the message on to the next rank."""
    xp = backend_of(q).xp
    qs, ks, vs, gs = halves(q), halves(kv[0]), halves(kv[1]), halves(g)
    lses, deltas = halves(lse, -1), halves(delta, -1)
    dq = list(dq)
    dk, dv = ([None, None], [None, None]) if dkv is None else (halves(dkv[0]), halves(dkv[1]))
    for i, j, diagonal in pairs:
        pos = xp.arange(qs[i].shape[-2])
        a, b, c = block_attention_grads(qs[i], ks[j], vs[j], gs[i], lses[i], deltas[i], pos, pos, scale,
                                        diagonal)
        dq[i], dk[j], dv[j] = _plus(dq[i], a), _plus(dk[j], b), _plus(dv[j], c)
    dk, dv = ([xp.zeros_like(x) if d is None else d for x, d in zip(ks, ds)] for ds in (dk, dv))
    return dq, xp.stack([xp.concatenate(dk, axis=-2), xp.concatenate(dv, axis=-2)])


# -- the ops' layouts in and out of the ring's chunks ------------------------------------------------

@compiled.pure
def _unpack(qkv, heads):
    """The fused projections (B, T, 3·H·D) -> q (B, H, T, D) and the K/V block (2, B, H, T, D)
    (views on NumPy)."""
    b, t, c = qkv.shape
    x = qkv.reshape(b, t, 3, heads, c // (3 * heads)).transpose(2, 0, 3, 1, 4)
    return x[0], x[1:]


@compiled.pure
def _results(out, lse, packed):
    """The query chunks' results -> out (B, H, T, D) and lse (B, H, T), and ``packed``: out as
    (B, T, H·D) too."""
    xp = backend_of(out[0]).xp
    o, lse = xp.concatenate(out, axis=-2), xp.concatenate(lse, axis=-1)
    return (o, lse, merge_heads(o)) if packed else (o, lse)


@compiled.pure
def _backward_inputs(g, o, heads):
    """The output gradient as (B, H, T, D) (split from (B, T, H·D) when ``heads``), and delta."""
    if heads:
        b, t, c = g.shape
        g = g.reshape(b, t, heads, c // heads).transpose(0, 2, 1, 3)
    return g, softmax_correction(g, o)


@compiled.pure
def _gradients(dq, dkv, packed):
    """dQ's chunks and dK/dV (2, B, H, T, D) -> dq, dk, dv, or ``packed``: qkv's (B, T, 3·H·D)."""
    xp = backend_of(dkv).xp
    dq = xp.concatenate(dq, axis=-2)
    if not packed:
        return dq, dkv[0], dkv[1]
    _, b, h, t, d = dkv.shape
    return xp.stack([dq, dkv[0], dkv[1]]).transpose(1, 3, 0, 2, 4).reshape(b, t, 3 * h * d)


@dataclass
class AttentionStats:
    """What one rank computed: chunk pairs and matmul FLOPs (2·c·c·D each for QKᵀ and PV forward,
    twice that backward), counted as they run."""
    pairs: int = 0
    forward_flops: int = 0
    backward_flops: int = 0

    def count(self, backward: bool, pairs: int, q_shape) -> None:
        """Add one step's ``pairs`` chunk pairs of queries shaped (B, H, 2c, D)."""
        b, h, t, d = q_shape
        flops = pairs * 4 * b * h * (t // 2) ** 2 * d
        if backward:
            self.backward_flops += 2 * flops
        else:
            self.pairs += pairs
            self.forward_flops += flops


# -- the autograd ops --------------------------------------------------------------------------------

class RingAttention(Function):
    """Attention of this rank's queries over every rank's keys, K/V passed round the ring ``comm``.

    q, k, v: (B, H, T/cp, D), this rank's two chunks; ``pairs(src)``: the chunk pairs to compute
    with rank src's block (``layout.chunk_pairs``).
    """

    @staticmethod
    def forward(ctx, q, k, v, comm, pairs, stats=None):
        o, lse = _results(*ring_forward(comm, q, (k, v), pairs, stats), False)
        ctx.save(q, k, v, o, lse)
        ctx.comm, ctx.pairs, ctx.stats = comm, pairs, stats
        return o

    @staticmethod
    def backward(ctx, g):
        q, k, v, o, lse = ctx.saved
        g, delta = _backward_inputs(g, o, 0)
        return _gradients(*ring_backward(ctx.comm, q, (k, v), g, lse, delta, ctx.pairs, ctx.stats), False)


class PackedRingAttention(Function):
    """Ring attention of the fused projections ``qkv`` (B, T/cp, 3·H·D) over ``heads`` heads:
    (B, T/cp, H·D), as the serial layer's ``ops.packed_attention``: the heads split and merged
    inside one op (a split into q, k, v would be five ops and five backwards)."""

    @staticmethod
    def forward(ctx, qkv, comm, heads, pairs, stats=None):
        q, kv = _unpack(qkv, heads)
        o, lse, y = _results(*ring_forward(comm, q, kv, pairs, stats), True)
        ctx.save(q, kv, o, lse)
        ctx.comm, ctx.heads, ctx.pairs, ctx.stats = comm, heads, pairs, stats
        return y

    @staticmethod
    def backward(ctx, g):
        q, kv, o, lse = ctx.saved
        g, delta = _backward_inputs(g, o, ctx.heads)
        return _gradients(*ring_backward(ctx.comm, q, kv, g, lse, delta, ctx.pairs, ctx.stats), True)


def _pairs_with(t_local: int, comm, layout: str, causal: bool):
    """src -> the chunk pairs this rank computes with rank src's block, after checking that the
    sequence splits into 2·cp chunks."""
    check_sequence(t_local * comm.size, comm.size, comm.rank)
    mine = chunk_ids(comm.rank, comm.size, layout)
    pairs = [chunk_pairs(mine, chunk_ids(src, comm.size, layout), causal) for src in range(comm.size)]
    return pairs.__getitem__


def ring_attention(q, k, v, comm, layout: str = "zigzag", causal: bool = True, stats=None):
    """Differentiable ring attention of Tensors q, k, v (B, H, T/cp, D) over the cp group ``comm``."""
    pairs = _pairs_with(q.shape[-2], comm, layout, causal)
    return RingAttention.apply(q, k, v, comm=comm, pairs=pairs, stats=stats)


def packed_ring_attention(qkv, heads: int, comm, layout: str = "zigzag", causal: bool = True, stats=None):
    """Ring attention of the fused projections (a Tensor (B, T/cp, 3·H·D)): (B, T/cp, H·D)."""
    ops.check_packed(qkv, heads, f"rank {comm.rank}: packed_ring_attention")
    pairs = _pairs_with(qkv.shape[1], comm, layout, causal)
    return PackedRingAttention.apply(qkv, comm=comm, heads=heads, pairs=pairs, stats=stats)


def ring_bytes(n_elements: int, itemsize: int, cp: int) -> dict:
    """Bytes one rank sends: K and V (n_elements each) forward; K, V and dK, dV backward."""
    kv = 2 * n_elements * itemsize
    return {"forward": (cp - 1) * kv, "backward": (cp - 1) * kv + (cp * kv if cp > 1 else 0)}
