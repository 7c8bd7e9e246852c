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

from minidist import jax_engine, trace
from minidist.backend import backend_of
from minidist.nn.attention import merge_heads, split_heads
from minidist.nn.module import Module
from minidist.tensor import Function

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


# The ring's array steps below are pure functions: on NumPy they run as written; on JAX each is one
# compiled call per shape (``jax_engine.pure``) instead of a dozen eager primitives -- each one a
# dispatch, and a program of its own per shape -- for every pair of blocks and every hop.

@jax_engine.pure
def _attend_block(q, kv, j, half, q_pos, k_pos, scale, causal, out, lse):
    """Queries ``q`` over key/value half ``j`` of ``kv`` (2, B, H, T/cp, D), merged into (out, lse)."""
    kj = slice(j * half, (j + 1) * half)
    o, l_ = block_attention(q, kv[0][..., kj, :], kv[1][..., kj, :], q_pos, k_pos, scale, causal)
    return merge_attention(out, lse, o, l_)


@jax_engine.pure
def _block_grads(q, kv, g, lse, delta, i, j, half, q_pos, k_pos, scale, causal, dq, dk, dv):
    """Query half ``i`` against key/value half ``j`` backward: (dq, dk, dv) plus this pair's part.
    The softmax is recomputed from the saved lse; ``delta`` = rowsum(dO ∘ O) corrects its backward."""
    xp = backend_of(q).xp
    qi, kj = slice(i * half, (i + 1) * half), slice(j * half, (j + 1) * half)
    kb, vb = kv[0][..., kj, :], kv[1][..., kj, :]
    sc = _scores(q[..., qi, :], kb, q_pos, k_pos, scale, causal)
    pr = xp.exp(sc - lse[..., qi, None])           # the final softmax, recomputed
    gi = g[..., qi, :]
    dv = dv + xp.swapaxes(pr, -1, -2) @ gi
    ds = pr * (gi @ xp.swapaxes(vb, -1, -2) - delta[..., qi, None]) * q.dtype.type(scale)
    return dq + ds @ kb, dk + xp.swapaxes(ds, -1, -2) @ q[..., qi, :], dv


@jax_engine.pure
def _halves(x, half):
    """x[..., :half, :] and x[..., half:, :] (the two chunks a rank holds)."""
    return x[..., :half, :], x[..., half:, :]


@jax_engine.pure
def _stack(a, b):
    return backend_of(a).xp.stack([a, b])


@jax_engine.pure
def _join(a, b, axis):
    return backend_of(a).xp.concatenate([a, b], axis=axis)


@jax_engine.pure
def _start_forward(q, half):
    """The query halves, and their empty results: out 0, lse -inf (no key seen yet)."""
    xp = backend_of(q).xp
    qs = _halves(q, half)
    return qs, [xp.zeros_like(x) for x in qs], [xp.full(x.shape[:-1], -xp.inf, dtype=q.dtype) for x in qs]


@jax_engine.pure
def _start_backward(g, o, q, half):
    """delta = rowsum(dO ∘ O), the softmax backward's correction term, and zeros for a half's grads."""
    xp = backend_of(g).xp
    return (g * o).sum(axis=-1), xp.zeros(q[..., :half, :].shape, dtype=q.dtype)


@jax_engine.pure
def _pack_grads(dkv):
    """[[dK halves], [dV halves]] -> one (2, B, H, T/cp, D) array, the message to the next rank."""
    xp = backend_of(dkv[0][0]).xp
    return xp.stack([xp.concatenate(dkv[0], axis=-2), xp.concatenate(dkv[1], axis=-2)])


@jax_engine.pure
def _unpack_grads(got, half):
    return [list(_halves(got[a], half)) for a in range(2)]


def visible(q_pos, k_pos, causal) -> bool:
    """Does any query of this pair see any key? (Fully hidden pairs are skipped, not computed.)"""
    return (not causal) or int(k_pos.min()) <= int(q_pos.max())


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


class RingAttention(Function):
    """Attention of this rank's queries over every rank's keys, K/V passed round the ring ``comm``.

    q, k, v: (B, H, T/cp, D) of the tokens at ``positions(rank)`` (global positions, two chunks).
    """

    @staticmethod
    def forward(ctx, q, k, v, comm, positions, causal=True, stats=None):
        ring, r, p = comm.twin("ring_attention"), comm.rank, comm.size
        scale = 1.0 / math.sqrt(q.shape[-1])
        half = q.shape[-2] // 2
        qs, out, lse = _start_forward(q, half)
        q_pos = positions(r)
        qp = [q_pos[:half], q_pos[half:]]
        kv = _stack(k, v)
        tracer = _tracer()
        for s in range(p):
            src = (r - s) % p
            if s < p - 1:  # start moving the next block before computing on this one
                t0 = tracer.now() if tracer is not None else 0.0
                recv = ring.irecv((r - 1) % p, tag=0)
                send = ring.isend(kv, (r + 1) % p, tag=0)
            with _step(tracer, "F", src):
                k_pos = positions(src)
                for i in range(2):
                    for j in range(2):
                        kp = k_pos[j * half:(j + 1) * half]
                        if not visible(qp[i], kp, causal):
                            continue
                        out[i], lse[i] = _attend_block(qs[i], kv, j, half, qp[i], kp, scale, causal,
                                                       out[i], lse[i])
                        if stats is not None:
                            stats.pairs += 1
                            stats.forward_flops += 4 * math.prod(q.shape[:2]) * half * half * q.shape[-1]
            if s < p - 1:
                send.wait()
                kv = recv.wait()
                _in_flight(tracer, t0, "K/V")
        o = _join(*out, axis=-2)
        ctx.save(q, k, v, o, _join(*lse, axis=-1))
        ctx.comm, ctx.positions, ctx.causal, ctx.stats, ctx.scale = comm, positions, causal, stats, scale
        return o

    @staticmethod
    def backward(ctx, g):
        q, k, v, o, lse = ctx.saved
        ring, r, p = ctx.comm.twin("ring_attention"), ctx.comm.rank, ctx.comm.size
        half, scale, causal = q.shape[-2] // 2, ctx.scale, ctx.causal
        q_pos = ctx.positions(r)
        delta, zeros = _start_backward(g, o, q, half)  # delta = rowsum(dO ∘ O)
        # accumulated per chunk half, never in place (JAX arrays are immutable): dq[i], and the dK, dV
        # of the block in hand, dkv[0][j] and dkv[1][j]
        dq, dkv = [zeros, zeros], [[zeros, zeros], [zeros, zeros]]
        kv = _stack(k, v)
        tracer = _tracer()
        for s in range(p):
            src = (r - s) % p
            if s < p - 1:
                t0 = tracer.now() if tracer is not None else 0.0
                recv = ring.irecv((r - 1) % p, tag=1)
                send = ring.isend(kv, (r + 1) % p, tag=1)
            with _step(tracer, "B", src):
                k_pos = ctx.positions(src)
                for i in range(2):
                    qi = slice(i * half, (i + 1) * half)
                    for j in range(2):
                        kj = slice(j * half, (j + 1) * half)
                        if not visible(q_pos[qi], k_pos[kj], causal):
                            continue
                        dq[i], dkv[0][j], dkv[1][j] = _block_grads(
                            q, kv, g, lse, delta, i, j, half, q_pos[qi], k_pos[kj], scale, causal,
                            dq[i], dkv[0][j], dkv[1][j])
                        if ctx.stats is not None:
                            ctx.stats.backward_flops += 8 * math.prod(q.shape[:2]) * half * half * q.shape[-1]
            if s < p - 1:
                send.wait()
                kv = recv.wait()
                _in_flight(tracer, t0, "K/V")
            if p > 1:  # dK, dV of block src go on with it (to its owner, after the last hop)
                t1 = tracer.now() if tracer is not None else 0.0
                got = ring.sendrecv(_pack_grads(dkv), (r + 1) % p, (r - 1) % p, sendtag=2, recvtag=2)
                dkv = _unpack_grads(got, half)
                _in_flight(tracer, t1, "dK/dV")
        return _join(*dq, axis=-2), _join(*dkv[0], axis=-2), _join(*dkv[1], axis=-2)


def ring_attention(q, k, v, comm, layout: str = "zigzag", causal: bool = True, stats=None):
    """Differentiable ring attention of Tensors q, k, v (B, H, T/cp, D) over the cp group ``comm``."""
    t_total = q.shape[-2] * comm.size
    check_sequence(t_total, comm.size, comm.rank)
    table = {r: chunk_positions(t_total, comm.size, r, layout) for r in range(comm.size)}
    return RingAttention.apply(q, k, v, comm=comm, positions=table.__getitem__, causal=causal, stats=stats)


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
        q, k, v = split_heads(self.qkv(x), self.heads)
        y = ring_attention(q, k, v, self.cp, self.layout, stats=self.stats)
        return self.drop(self.proj(merge_heads(y)))


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
