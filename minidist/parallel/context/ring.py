"""Context parallelism: the sequence split over a ``cp`` group, attention by passing K/V round a ring.

A long sequence of T tokens does not fit one rank's activations, so each of the cp ranks holds
T/cp of them (every layer but attention works token by token and needs nothing else). Attention
needs every earlier key, so **ring attention** (Liu et al. 2023) passes them round:

* each rank keeps its query block; its key/value block travels round the ring, one hop per step.
  At step s rank r holds the K/V of rank (r - s) mod cp, and *while* it attends to that block it
  is already sending it on to r + 1 and receiving the next one from r - 1 (``isend``/``irecv``
  started before the compute, waited for after it: the transfer hides behind the matmuls);
* partial results of the blocks are merged with the online-softmax (log-sum-exp) rule of
  FlashAttention, :func:`merge_attention`: out = (e^{l_a}·out_a + e^{l_b}·out_b) / (e^{l_a} + e^{l_b});
* backward rings again: K/V travel the same way, and with them the gradients dK, dV each rank adds
  for the block it holds; after cp hops every block's dK, dV is back at its owner.

**Causal load balance.** With the causal mask, rank r's queries see only keys of ranks <= r: cut
the sequence into cp contiguous blocks and rank cp-1 does cp times the work of rank 0. Cut it
into 2·cp chunks and give rank r chunks r and 2cp-1-r (**zig-zag**, Megatron-LM's CP) and every
rank computes the same 2cp+1 chunk pairs (:func:`chunk_positions`; measured in ``AttentionStats``).

Bytes per rank (ledger; b·h·(T/cp)·d elements of K, V and of dK, dV, each ``itemsize`` bytes):
forward 2(cp-1)·N, backward 2(cp-1)·N (K, V) + 2·cp·N (dK, dV; none when cp = 1): :func:`ring_bytes`.

``context_parallel(model, cp)`` turns a GPT (or a TPGPT: heads over tp, sequence over cp) into its
context-parallel self; each rank feeds it its own tokens (:func:`shard_sequence`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np

from minidist import trace
from minidist.accel import jax_engine
from minidist.accel.backend import backend_of
from minidist.autograd import ops
from minidist.autograd.tensor import Function
from minidist.nn.attention import merge_heads
from minidist.nn.module import Module

LAYOUTS = ("zigzag", "contiguous")


# -- which tokens a rank holds ------------------------------------------------------------------

def check_sequence(t_total: int, cp: int, rank: int = 0) -> int:
    """The chunk length T / (2·cp), or a ValueError saying which lengths work."""
    if t_total % (2 * cp):
        raise ValueError(f"rank {rank}: sequence length {t_total} does not split into 2 x cp = {2 * cp} "
                         f"equal chunks; use a length that is a multiple of {2 * cp}")
    return t_total // (2 * cp)


def chunk_ids(rank: int, cp: int, layout: str = "zigzag") -> tuple[int, int]:
    """The two of the 2·cp chunks rank ``rank`` holds: (r, 2cp-1-r) zig-zag, (2r, 2r+1) contiguous."""
    if layout == "zigzag":
        return rank, 2 * cp - 1 - rank
    if layout == "contiguous":
        return 2 * rank, 2 * rank + 1
    raise ValueError(f"rank {rank}: unknown context-parallel layout {layout!r}; use one of {LAYOUTS}")


def chunk_positions(t_total: int, cp: int, rank: int, layout: str = "zigzag") -> np.ndarray:
    """Global positions of the T/cp tokens rank ``rank`` holds, in the order it holds them."""
    c = check_sequence(t_total, cp, rank)
    return np.concatenate([np.arange(i * c, (i + 1) * c) for i in chunk_ids(rank, cp, layout)])


def shard_sequence(x, cp_rank: int, cp: int, layout: str = "zigzag", axis: int = 1):
    """This rank's tokens of x (e.g. ids (B, T), or targets) along ``axis``."""
    return np.take(x, chunk_positions(x.shape[axis], cp, cp_rank, layout), axis=axis)


def unshard_sequence(parts: list, layout: str = "zigzag", axis: int = 1):
    """Inverse of :func:`shard_sequence`: every rank's part (rank order) -> the whole sequence."""
    cp = len(parts)
    t = sum(p.shape[axis] for p in parts)
    order = np.concatenate([chunk_positions(t, cp, r, layout) for r in range(cp)])
    whole = np.concatenate(parts, axis=axis)
    return np.take(whole, np.argsort(order), axis=axis)


# -- one block of attention, and the merge -------------------------------------------------------

@jax_engine.pure  # on JAX one compiled program per block shape (eager: ~10)
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


def _scores(q, k, q_pos, k_pos, scale, causal):
    xp = backend_of(q).xp
    s = (q @ xp.swapaxes(k, -1, -2)) * q.dtype.type(scale)
    if causal:
        s = xp.where(xp.asarray(k_pos[None, :] > q_pos[:, None]), xp.asarray(-xp.inf, dtype=s.dtype), s)
    return s


@jax_engine.pure
def block_attention(q, k, v, q_pos, k_pos, scale, causal=True):
    """softmax(q·kᵀ·scale, keys after a query hidden)·v and its lse, for one block pair."""
    xp = backend_of(q).xp
    s = _scores(q, k, q_pos, k_pos, scale, causal)
    m = s.max(axis=-1, keepdims=True)
    m = xp.where(xp.isfinite(m), m, 0.0)
    e = xp.exp(s - m)
    total = e.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = (xp.log(total) + m)[..., 0]
    return (e / xp.where(total > 0, total, 1.0)) @ v, lse


# -- which chunk pairs a ring step computes ---------------------------------------------------------

def chunk_pairs(q_chunks, k_chunks, causal: bool = True) -> tuple:
    """The pairs (i, j, diagonal) of query chunk ``q_chunks[i]`` and key chunk ``k_chunks[j]`` that
    see any key, in the order they are merged. Chunks are whole, equal and contiguous, so under the
    causal mask a pair is fully visible (keys of an earlier chunk), the causal triangle (the same
    chunk: ``diagonal``), or hidden (a later chunk: skipped, not computed)."""
    return tuple((i, j, causal and kc == qc) for i, qc in enumerate(q_chunks)
                 for j, kc in enumerate(k_chunks) if not causal or kc <= qc)


# The ring's array work, in pure functions (``jax_engine.pure``): on NumPy they run as written; on
# JAX each is one compiled call. A chunk pair's attention and merge (or its backward) is one call
# whose program depends only on the chunk shape and whether the pair is diagonal -- the chunks are
# passed in, not picked inside by index -- so a shape needs two programs each way, whichever ranks,
# steps and chunks meet (and a program's size, not only their number, is what loading one costs).
# The rings work on chunks; each op's start and finish (one call each) turn its layout into chunks
# and back.

def _half(x, i, axis=-2):
    """Chunk ``i`` (0 or 1) of the two a rank holds, along ``axis`` (the token axis)."""
    n = x.shape[axis] // 2
    return x[(Ellipsis, slice(i * n, (i + 1) * n)) + (slice(None),) * (-axis - 1)]


def _halves(x, axis=-2):
    return [_half(x, 0, axis), _half(x, 1, axis)]


def _empty(qs):
    """Each query chunk's results before any key: out 0, lse -inf."""
    xp = backend_of(qs[0]).xp
    return [xp.zeros_like(x) for x in qs], [xp.full(x.shape[:-1], -xp.inf, dtype=x.dtype) for x in qs]


def _backward_chunks(q, g, o, lse):
    """The chunks of q, dO, lse and delta = rowsum(dO ∘ O) (the softmax backward's correction), and
    zeros for the chunks of dQ and of the dK, dV of the block in hand."""
    xp = backend_of(q).xp
    zero = xp.zeros_like(_half(q, 0))
    return (_halves(q), _halves(g), _halves(lse, -1), _halves((g * o).sum(axis=-1), -1),
            [zero, zero], [[zero, zero], [zero, zero]])


@jax_engine.pure
def _split_block(kv):
    """A K/V block, or its dK/dV, (2, B, H, T/cp, D) -> [[k0, k1], [v0, v1]], its chunks."""
    return [_halves(kv[0]), _halves(kv[1])]


@jax_engine.pure
def _attend_pair(q, k, v, out, lse, scale, diagonal):
    """Query chunk ``q`` over key chunk ``k`` (``diagonal``: the same chunk, keys after a query
    hidden), merged into that query chunk's (out, lse)."""
    pos = backend_of(q).xp.arange(q.shape[-2])
    o, l_ = block_attention(q, k, v, pos, pos, scale, diagonal)
    return merge_attention(out, lse, o, l_)


@jax_engine.pure
def _pair_grads(q, k, v, g, lse, delta, dq, dk, dv, scale, diagonal):
    """Query chunk ``q`` against key chunk ``k`` backward: (dq, dk, dv) plus this pair's part. The
    softmax is recomputed from the saved lse; ``delta`` corrects its backward."""
    xp = backend_of(q).xp
    pos = xp.arange(q.shape[-2])
    pr = xp.exp(_scores(q, k, pos, pos, scale, diagonal) - lse[..., None])  # the final softmax
    dv = dv + xp.swapaxes(pr, -1, -2) @ g
    ds = pr * (g @ xp.swapaxes(v, -1, -2) - delta[..., None]) * q.dtype.type(scale)
    return dq + ds @ k, dk + xp.swapaxes(ds, -1, -2) @ q, dv


@jax_engine.pure
def _pack_grads(dkv):
    """[[dk0, dk1], [dv0, dv1]] -> one (2, B, H, T/cp, D) array, the message to the next rank."""
    xp = backend_of(dkv[0][0]).xp
    return xp.stack([xp.concatenate(dkv[0], axis=-2), xp.concatenate(dkv[1], axis=-2)])


def _join(chunks, axis=-2):
    return backend_of(chunks[0]).xp.concatenate(chunks, axis=axis)


@dataclass
class AttentionStats:
    """What one rank computed: chunk pairs and matmul FLOPs (2·Tq·Tk·D each for QKᵀ and PV forward,
    twice that backward), counted as they run."""
    pairs: int = 0
    forward_flops: int = 0
    backward_flops: int = 0


# -- ring attention ---------------------------------------------------------------------------------

def _tracer():
    """The rank's active tracer (``minidist.trace``), or None: spans cost nothing when it is off."""
    return trace.current()


@contextlib.contextmanager
def _step(tracer, letter, src):
    """A compute span 'F<src>' / 'B<src>' (attention on the block of rank src) on the timeline."""
    if tracer is None:
        yield
        return
    with tracer.span(letter, "compute", mb=src):
        yield


def _in_flight(tracer, t0, what):
    """Record a transfer from its start (``t0``) to now: drawn under the compute it overlapped."""
    if tracer is not None:
        tracer.add(what, "send", t0, tracer.now())


def _pair_flops(qs) -> int:
    """QKᵀ and PV of one chunk pair: 2 · 2·c·c·D per batch and head."""
    b, h, c, d = qs[0].shape
    return 4 * b * h * c * c * d


class _Hop:
    """A K/V block's move to the next rank of the ring (its own from the previous one), started
    before this rank computes on the block, so the transfer overlaps the compute."""

    def __init__(self, ring, kv, tag: int, tracer):
        self.tracer, self.t0 = tracer, tracer.now() if tracer is not None else 0.0
        self.recv = ring.irecv((ring.rank - 1) % ring.size, tag=tag)
        self.send = ring.isend(kv, (ring.rank + 1) % ring.size, tag=tag)

    def arrived(self):
        """The previous rank's block, once it is here and ours has left."""
        self.send.wait()
        kv = self.recv.wait()
        _in_flight(self.tracer, self.t0, "K/V")
        return kv


def _ring_forward(qs, kv, out, lse, comm, chunks, causal, stats):
    """The forward ring: this rank's query chunks ``qs`` (B, H, T/2cp, D) over every rank's K/V
    block, its own ``kv`` (2, B, H, T/cp, D) first; each block is sent on while this rank computes
    on it. ``out``, ``lse``: each query chunk's results so far. Returns them after the last block."""
    ring, r, p = comm.twin("ring_attention"), comm.rank, comm.size
    scale = 1.0 / math.sqrt(qs[0].shape[-1])
    tracer = _tracer()
    for s in range(p):
        src = (r - s) % p
        hop = _Hop(ring, kv, 0, tracer) if s < p - 1 else None  # moving on while this rank computes
        with _step(tracer, "F", src):
            pairs = chunk_pairs(chunks(r), chunks(src), causal)
            if pairs:
                ks, vs = _split_block(kv)
            for i, j, diagonal in pairs:
                out[i], lse[i] = _attend_pair(qs[i], ks[j], vs[j], out[i], lse[i], scale, diagonal)
            if stats is not None:
                stats.pairs += len(pairs)
                stats.forward_flops += len(pairs) * _pair_flops(qs)
        if hop is not None:
            kv = hop.arrived()
    return out, lse


def _ring_backward(qs, kv, gs, lses, deltas, dq, dkv, comm, chunks, causal, stats):
    """The backward ring: K/V travel round again, and with each block the dK, dV this rank adds
    for it (``dkv``: of the block in hand, by chunk); after cp hops every block's dK, dV is back at
    its owner. Returns (dQ's chunks, the (2, B, H, T/cp, D) dK/dV of this rank's own block)."""
    ring, r, p = comm.twin("ring_attention"), comm.rank, comm.size
    scale = 1.0 / math.sqrt(qs[0].shape[-1])
    tracer = _tracer()
    for s in range(p):
        src = (r - s) % p
        hop = _Hop(ring, kv, 1, tracer) if s < p - 1 else None
        with _step(tracer, "B", src):
            pairs = chunk_pairs(chunks(r), chunks(src), causal)
            if pairs:
                ks, vs = _split_block(kv)
            for i, j, diagonal in pairs:
                dq[i], dkv[0][j], dkv[1][j] = _pair_grads(qs[i], ks[j], vs[j], gs[i], lses[i], deltas[i],
                                                         dq[i], dkv[0][j], dkv[1][j], scale, diagonal)
            if stats is not None:
                stats.backward_flops += len(pairs) * 2 * _pair_flops(qs)
        if hop is not None:
            kv = hop.arrived()
        got = _pack_grads(dkv)
        if p > 1:  # dK, dV of block src go on with it (to its owner, after the last hop)
            t1 = tracer.now() if tracer is not None else 0.0
            got = ring.sendrecv(got, (r + 1) % p, (r - 1) % p, sendtag=2, recvtag=2)
            _in_flight(tracer, t1, "dK/dV")
            if s < p - 1:
                dkv = _split_block(got)
    return dq, got


@jax_engine.pure
def _start_forward(q, k, v):
    """q's chunks, the K/V block that travels (2, B, H, T/cp, D), and empty results."""
    qs = _halves(q)
    return (qs, backend_of(q).xp.stack([k, v]), *_empty(qs))


@jax_engine.pure
def _finish_forward(out, lse):
    return _join(out), _join(lse, axis=-1)


@jax_engine.pure
def _start_backward(q, k, v, g, o, lse):
    return (backend_of(q).xp.stack([k, v]), *_backward_chunks(q, g, o, lse))


@jax_engine.pure
def _finish_backward(dq, dkv):
    """dQ's chunks and this rank's (2, B, H, T/cp, D) dK/dV -> dQ, dK, dV."""
    return _join(dq), dkv[0], dkv[1]


class RingAttention(Function):
    """Attention of this rank's queries over every rank's keys, K/V passed round the ring ``comm``.

    q, k, v: (B, H, T/cp, D) of the two chunks ``chunks(rank)`` (chunk ids of the 2·cp; chunk c holds
    positions c·T/2cp .. (c+1)·T/2cp - 1).
    """

    @staticmethod
    def forward(ctx, q, k, v, comm, chunks, causal=True, stats=None):
        qs, kv, out, lse = _start_forward(q, k, v)
        o, lse = _finish_forward(*_ring_forward(qs, kv, out, lse, comm, chunks, causal, stats))
        ctx.save(q, k, v, o, lse)
        ctx.comm, ctx.chunks, ctx.causal, ctx.stats = comm, chunks, causal, stats
        return o

    @staticmethod
    def backward(ctx, g):
        q, k, v, o, lse = ctx.saved
        kv, qs, gs, lses, deltas, dq, dkv = _start_backward(q, k, v, g, o, lse)
        return _finish_backward(*_ring_backward(qs, kv, gs, lses, deltas, dq, dkv, ctx.comm, ctx.chunks,
                                                ctx.causal, ctx.stats))


# The packed form, as the serial layer's ``ops.packed_attention``: the fused projections qkv
# (B, T/cp, 3·H·D) in, (B, T/cp, H·D) out, the heads split and merged inside -- one op where a
# split into q, k, v would be five (reshape, transpose, three indexings) and their five backwards,
# qkv's gradient three zero-filled arrays added up. Its start and finish do the heads too.

@jax_engine.pure
def _start_packed(qkv, heads):
    """qkv (B, T, 3·H·D) -> q (B, H, T, D) (views on NumPy, no copy), its chunks, the K/V block
    (2, B, H, T, D), and empty results."""
    b, t, c = qkv.shape
    x = qkv.reshape(b, t, 3, heads, c // (3 * heads)).transpose(2, 0, 3, 1, 4)
    qs = _halves(x[0])
    return (x[0], qs, x[1:], *_empty(qs))


@jax_engine.pure
def _finish_packed(out, lse):
    """The chunks' results -> out (B, H, T, D) and lse (saved for backward), and out (B, T, H·D)."""
    o = _join(out)
    return o, _join(lse, axis=-1), merge_heads(o)


@jax_engine.pure
def _start_packed_backward(q, g, o, lse, heads):
    b, t, c = g.shape
    return _backward_chunks(q, g.reshape(b, t, heads, c // heads).transpose(0, 2, 1, 3), o, lse)


@jax_engine.pure
def _finish_packed_backward(dq, dkv):
    """dQ's chunks and dK/dV (2, B, H, T, D) -> qkv's gradient (B, T, 3·H·D)."""
    xp = backend_of(dkv).xp
    _, b, h, t, d = dkv.shape
    return xp.stack([_join(dq), dkv[0], dkv[1]]).transpose(1, 3, 0, 2, 4).reshape(b, t, 3 * h * d)


class PackedRingAttention(Function):
    """Ring attention of the fused projections ``qkv`` (B, T/cp, 3·H·D) over ``heads`` heads:
    (B, T/cp, H·D). The same rings as ``RingAttention``."""

    @staticmethod
    def forward(ctx, qkv, comm, heads, chunks, causal=True, stats=None):
        q, qs, kv, out, lse = _start_packed(qkv, heads)
        o, lse, y = _finish_packed(*_ring_forward(qs, kv, out, lse, comm, chunks, causal, stats))
        ctx.save(q, kv, o, lse)
        ctx.comm, ctx.heads, ctx.chunks, ctx.causal, ctx.stats = comm, heads, chunks, causal, stats
        return y

    @staticmethod
    def backward(ctx, g):
        q, kv, o, lse = ctx.saved
        qs, gs, lses, deltas, dq, dkv = _start_packed_backward(q, g, o, lse, ctx.heads)
        return _finish_packed_backward(*_ring_backward(qs, kv, gs, lses, deltas, dq, dkv, ctx.comm,
                                                       ctx.chunks, ctx.causal, ctx.stats))


def _chunk_table(t_local, comm, layout):
    """rank -> its two chunk ids, after checking the sequence splits into 2·cp chunks."""
    check_sequence(t_local * comm.size, comm.size, comm.rank)
    return {r: chunk_ids(r, comm.size, layout) for r in range(comm.size)}.__getitem__


def ring_attention(q, k, v, comm, layout: str = "zigzag", causal: bool = True, stats=None):
    """Differentiable ring attention of Tensors q, k, v (B, H, T/cp, D) over the cp group ``comm``."""
    chunks = _chunk_table(q.shape[-2], comm, layout)
    return RingAttention.apply(q, k, v, comm=comm, chunks=chunks, causal=causal, stats=stats)


def packed_ring_attention(qkv, heads: int, comm, layout: str = "zigzag", causal: bool = True, stats=None):
    """Ring attention of the fused projections (a Tensor (B, T/cp, 3·H·D)): (B, T/cp, H·D)."""
    ops.check_packed(qkv, heads, f"rank {comm.rank}: packed_ring_attention")
    chunks = _chunk_table(qkv.shape[1], comm, layout)
    return PackedRingAttention.apply(qkv, comm=comm, heads=heads, chunks=chunks, causal=causal, stats=stats)


def ring_bytes(n_elements: int, itemsize: int, cp: int) -> dict:
    """Bytes one rank sends: K and V (n_elements each) forward; K, V and dK, dV backward."""
    kv = 2 * n_elements * itemsize
    return {"forward": (cp - 1) * kv, "backward": (cp - 1) * kv + (cp * kv if cp > 1 else 0)}


# -- a context-parallel GPT ------------------------------------------------------------------------

class ContextParallelAttention(Module):
    """An attention layer (serial or tensor-parallel: its heads) whose attention rings over ``cp``."""

    def __init__(self, attn, cp, layout="zigzag"):
        super().__init__()
        self.qkv, self.proj, self.drop = attn.qkv, attn.proj, attn.drop
        object.__setattr__(self, "heads", getattr(attn, "local_heads", attn.n_head))
        object.__setattr__(self, "cp", cp)
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "stats", AttentionStats())

    def forward(self, x, cache=None):
        if cache is not None:
            raise ValueError(f"rank {self.cp.rank}: context parallelism is for training; decode without it")
        y = packed_ring_attention(self.qkv(x), self.heads, self.cp, self.layout, stats=self.stats)
        return self.drop(self.proj(y))


class ContextParallelEmbed(Module):
    """Token + position embedding of this rank's tokens: their positions are the global ones."""

    def __init__(self, embed, cp, layout="zigzag"):
        super().__init__()
        self.wte, self.wpe, self.drop = embed.wte, embed.wpe, embed.drop
        object.__setattr__(self, "cp", cp)
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "block_size", embed.block_size)

    def forward(self, idx, start: int = 0):
        idx = idx.data if hasattr(idx, "data") and not isinstance(idx, np.ndarray) else idx
        t_total = idx.shape[1] * self.cp.size
        if start or t_total > self.block_size:
            raise ValueError(f"rank {self.cp.rank}: a context-parallel sequence starts at 0 and is at most "
                             f"block_size={self.block_size} long; got start={start}, length {t_total}")
        pos = chunk_positions(t_total, self.cp.size, self.cp.rank, self.layout)
        return self.drop(self.wte(idx) + self.wpe(pos))  # host positions, as ``minidist.nn.gpt.Embed``


def replace_child(parent: Module, name: str, new: Module) -> None:
    """Swap child ``name`` keeping its place in the parameter order (setattr would move it last)."""
    parent._modules[name] = new
    object.__setattr__(parent, name, new)


def context_parallel(model, cp, layout: str = "zigzag"):
    """Make ``model`` (a GPT or TPGPT: Embed, Blocks, Head) context parallel over ``cp``, in place.

    Each rank then feeds ``shard_sequence(idx, cp.rank, cp.size, layout)`` and its loss is the mean
    over its own tokens; parameter names and values are unchanged. Dropout would draw masks no
    serial model draws, so it is refused."""
    chunk_ids(cp.rank, cp.size, layout)
    cfg = getattr(model, "config", None)
    if cfg is not None and cfg.dropout:
        raise ValueError(f"rank {cp.rank}: context parallelism with dropout={cfg.dropout} is not built "
                         "(its masks would differ from the serial model's); use dropout=0")
    if getattr(model, "sequence_parallel", False):
        raise ValueError(f"rank {cp.rank}: context parallelism over a sequence-parallel TPGPT is not built; "
                         "build the TPGPT with sequence_parallel=False")
    replace_child(model, "0", ContextParallelEmbed(model[0], cp, layout))
    for block in list(model)[1:-1]:
        replace_child(block, "attn", ContextParallelAttention(block.attn, cp, layout))
    return model


def attention_stats(model) -> AttentionStats:
    """The sum of every ring-attention layer's counters in ``model``."""
    total = AttentionStats()
    for _, m in model.named_modules():
        if isinstance(m, ContextParallelAttention):
            for f in ("pairs", "forward_flops", "backward_flops"):
                setattr(total, f, getattr(total, f) + getattr(m.stats, f))
    return total
