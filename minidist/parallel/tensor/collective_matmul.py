"""Collective matmul (async tensor parallelism): the sequence-parallel all-gather and reduce-scatter,
decomposed into p ring steps that each multiply the shard in hand while the next one travels.

Sequence-parallel tensor parallelism (``comm.gather_from_seq`` / ``reduce_scatter_to_seq``) stops
for every collective: the column-parallel layer waits for the whole sequence before its GEMM, the
row-parallel one finishes its GEMM before reducing. Collective matmul (Wang et al., ASPLOS 2023;
the JAX scaling book; torchtitan's async TP) cuts both along the sequence into p chunks of t = T/p:

* **all-gather, then matmul** (:func:`all_gather_matmul`, a column-parallel layer):
  ``y = concat_seq(x_0 .. x_{p-1}) @ W_r``. At step s rank r holds rank (r-s)'s shard x_src; it
  starts passing it on to r+1 (and receiving the next from r-1), computes ``y[src] = x_src @ W_r``,
  then waits. p-1 hops of one shard: the ring all-gather's bytes.
* **matmul, then reduce-scatter** (:func:`matmul_reduce_scatter`, a row-parallel layer):
  ``y_r = Σ_j (x_j @ W_j)[chunk r]``. The partial sum destined for rank d starts at rank d+1 and
  walks the ring; at step s rank r computes its own part of chunk (r-s-1), adds what arrived,
  and sends it on while it computes the next part. p-1 hops of one chunk: the ring reduce-scatter's
  bytes, in its summation order.

Each pattern's backward is the other one: the all-gather matmul's dX is a matmul + reduce-scatter
of ``g @ W_rᵀ``, the reduce-scatter matmul's dX an all-gather + matmul of the gradient shards; dW is
one GEMM over the whole sequence, as in the plain layer (the column layer's runs while its first dX
hop travels). So forward and backward equal the
non-overlapped layers' arithmetic: the same products and the same reduction order, so bit-exact
wherever BLAS gives a block of rows the same results as the whole matrix (where it picks another
kernel -- a single row is a matrix-vector product -- a dot product's rounding apart).

The hops are minidist point-to-point (``isend``/``irecv`` on a private channel, sizes known: no
headers), started before the step's compute. The emulated link (``MINIDIST_LINK``) makes the sender
itself sleep for the transfer, as if the CPU pushed every byte; a real NIC sends while the CPU
computes, so under a link each hop runs on the communicator's async worker thread (a DMA engine).
With tracing on, every hop is a "send" span and every step's GEMM a "compute" span (the overlap
on the timeline). :func:`use_collective_matmul` switches a built model's sequence-parallel layers.
"""

from __future__ import annotations

import math

import numpy as np

from minidist import trace
from minidist.accel.backend import backend_of
from minidist.autograd.ops import low_precision
from minidist.autograd.tensor import Function
from minidist.comm.handles import start_async
from minidist.parallel.tensor.comm import SEQ_AXIS, check_divisible

CHANNEL = "collective_matmul"  # the private channel of the main-thread hops


# -- one hop round the ring ---------------------------------------------------------------------------

def _hop_on_worker(ch, host, clock):
    """On the async worker: pass ``host`` to rank r+1, receive rank r-1's. Returns (what arrived, and
    the start and end of the send: the time the link was busy)."""
    recv = ch.irecv_buffer(np.empty_like(host), (ch.rank - 1) % ch.size)
    t0 = clock() if clock is not None else 0.0
    ch.isend_buffer(host, (ch.rank + 1) % ch.size).wait()  # the emulated link sleeps in here
    t1 = clock() if clock is not None else 0.0
    return recv.wait(), t0, t1


class Hop:
    """``x`` on its way to rank r+1 while rank r-1's block comes in; ``wait()`` returns that block
    (in x's backend). Started before the compute it hides behind."""

    def __init__(self, comm, x, what: str):
        self.be, self.what, self.tracer = backend_of(x), what, trace.current()
        host = np.ascontiguousarray(self.be.to_host(x))
        clock = self.tracer.now if self.tracer is not None else None
        if comm.link is not None:
            self.job, self.reqs = start_async(comm, _hop_on_worker, host, clock), None
        else:
            ch, self.job, self.t0 = comm.channel(CHANNEL), None, clock() if clock else 0.0
            self.out = np.empty_like(host)
            self.reqs = (ch.irecv_buffer(self.out, (ch.rank - 1) % ch.size),
                         ch.isend_buffer(host, (ch.rank + 1) % ch.size))

    def wait(self):
        if self.job is not None:
            got, t0, t1 = self.job.wait()
        else:
            self.reqs[1].wait()
            got, t0 = self.reqs[0].wait(), self.t0
            t1 = self.tracer.now() if self.tracer is not None else 0.0
        if self.tracer is not None:
            self.tracer.add(self.what, "send", t0, t1)
        return self.be.from_host(got)


# -- the two rings ----------------------------------------------------------------------------------

def gather_ring(comm, shard, compute, what: str = "x") -> None:
    """Visit every rank's ``shard``: at step s call ``compute(src, shard of rank src)`` with
    src = (r - s) mod p, while that shard travels on to rank r+1."""
    r, p = comm.rank, comm.size
    for s in range(p):
        src = (r - s) % p
        hop = Hop(comm, shard, what) if s < p - 1 else None
        with trace.span(f"mm{src}", "compute"):
            compute(src, shard)
        if hop is not None:
            shard = hop.wait()


def reduce_scatter_ring(comm, partial, what: str = "partial sum", beside=None):
    """Σ over ranks of ``partial(d)`` for d = this rank: at step s compute ``partial(r-s-1)``, add the
    running sum that arrived from rank r-1, send it on (the ring reduce-scatter's order).
    ``beside()``: other work that needs no communication, done while the first hop travels."""
    r, p = comm.rank, comm.size
    hop = None
    for s in range(p):
        if s == 1 and beside is not None:
            with trace.span("mm dW", "compute"):
                beside()
        with trace.span(f"mm{(r - s - 1) % p}", "compute"):
            part = partial((r - s - 1) % p)
        if hop is not None:
            part = part + hop.wait()
        if s == p - 1:
            if p == 1 and beside is not None:
                beside()
            return part
        hop = Hop(comm, part, what)


# -- products and chunks, as ``ops.Linear`` computes them -------------------------------------------

def _product(x, w):
    """x (..., k) @ w (k, n) as one 2-D GEMM of the rows (``ops.Linear``'s way)."""
    return (x.reshape(math.prod(x.shape[:-1]), x.shape[-1]) @ w).reshape(x.shape[:-1] + w.shape[1:])


def _chunk(x, i: int, t: int):
    return x[:, i * t:(i + 1) * t]


def _sum_rows(g):
    rows = g.reshape(math.prod(g.shape[:-1]), g.shape[-1])
    return backend_of(g).xp.ones(rows.shape[0], dtype=g.dtype) @ rows


def _weight_grad(x, g):
    return x.reshape(-1, x.shape[-1]).T @ g.reshape(-1, g.shape[-1])


def _check(x, w, comm, what: str, sharded: bool):
    if low_precision(w.dtype):  # ops.linear's fp32 accumulation is not rebuilt here
        raise ValueError(f"rank {comm.rank}: {what} with {w.dtype} weights is not built (mixed precision "
                         "accumulates in float32 inside ops.linear); use collective_matmul=False")
    if x.ndim != 3 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"rank {comm.rank}: {what} needs x of shape (batch, sequence, {w.shape[0]}), got "
                         f"{tuple(x.shape)}")
    if not sharded:
        check_divisible(comm, "sequence length (collective matmul)", x.shape[SEQ_AXIS])


# -- the autograd ops -------------------------------------------------------------------------------

class AllGatherMatmul(Function):
    """``concat_seq(x over the group) @ w (+ b)``: x (B, T/p, k) a sequence shard, w (k, n) -> (B, T, n)."""

    @staticmethod
    def forward(ctx, x, w, b=None, comm=None):
        _check(x, w, comm, "all_gather_matmul", sharded=True)
        p, xp = comm.size, backend_of(x).xp
        shards, outs = [None] * p, [None] * p

        def compute(src, xs):
            shards[src], outs[src] = xs, _product(xs, w) if b is None else _product(xs, w) + b

        gather_ring(comm, x, compute, "x shard")
        ctx.save(xp.concatenate(shards, axis=SEQ_AXIS), w)
        ctx.comm, ctx.t = comm, x.shape[SEQ_AXIS]
        return xp.concatenate(outs, axis=SEQ_AXIS)

    @staticmethod
    def backward(ctx, g):
        x_full, w = ctx.saved
        need = ctx.needs_grad
        dw = [None]

        def weight_grad():  # one GEMM over the whole sequence, while the first dx hop travels
            if need[1]:
                dw[0] = _weight_grad(x_full, g)

        if need[0]:
            dx = reduce_scatter_ring(ctx.comm, lambda d: _product(_chunk(g, d, ctx.t), w.T), "dx partial",
                                     beside=weight_grad)
        else:
            dx = None
            weight_grad()
        return (dx, dw[0]) + ((_sum_rows(g),) if len(need) > 2 else ())


class MatmulReduceScatter(Function):
    """My sequence chunk of ``Σ_ranks x @ w``: x (B, T, k) this rank's features, w (k, n) -> (B, T/p, n)."""

    @staticmethod
    def forward(ctx, x, w, comm=None):
        _check(x, w, comm, "matmul_reduce_scatter", sharded=False)
        t = x.shape[SEQ_AXIS] // comm.size
        ctx.save(x, w)
        ctx.comm = comm
        return reduce_scatter_ring(comm, lambda d: _product(_chunk(x, d, t), w), "y partial")

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved
        p, xp = ctx.comm.size, backend_of(g).xp
        shards, dxs = [None] * p, [None] * p

        def compute(src, gs):
            shards[src] = gs
            if ctx.needs_grad[0]:
                dxs[src] = _product(gs, w.T)

        gather_ring(ctx.comm, g, compute, "dy shard")
        dx = xp.concatenate(dxs, axis=SEQ_AXIS) if ctx.needs_grad[0] else None
        dw = _weight_grad(x, xp.concatenate(shards, axis=SEQ_AXIS)) if ctx.needs_grad[1] else None
        return dx, dw


def check_overlap(comm, collective_matmul: bool, sequence_parallel: bool) -> bool:
    """A layer's ``collective_matmul`` flag, refused without sequence parallelism (nothing to overlap)."""
    if collective_matmul and not sequence_parallel:
        raise ValueError(f"rank {comm.rank}: collective_matmul=True overlaps the sequence-parallel "
                         "all-gather and reduce-scatter; build the layer with sequence_parallel=True")
    return bool(collective_matmul)


def all_gather_matmul(x, w, b, comm):
    """The column-parallel layer's ``linear(gather_from_seq(x), w, b)``, overlapped."""
    return AllGatherMatmul.apply(x, w, comm=comm) if b is None else AllGatherMatmul.apply(x, w, b, comm=comm)


def matmul_reduce_scatter(x, w, comm):
    """The row-parallel layer's ``reduce_scatter_to_seq(linear(x, w))``, overlapped."""
    return MatmulReduceScatter.apply(x, w, comm=comm)


def use_collective_matmul(model, on: bool = True) -> int:
    """Switch every sequence-parallel Column/RowParallelLinear in ``model`` to collective matmul (or
    back); returns how many layers were switched. Raises if the model has none. (The layers are known
    by their ``collective_matmul`` attribute: ``layers.py`` imports this file.)"""
    layers = [m for _, m in model.named_modules()
              if hasattr(m, "collective_matmul") and getattr(m, "sequence_parallel", False)]
    if not layers:
        raise ValueError("use_collective_matmul: the model has no sequence-parallel tensor-parallel layer; "
                         "build it with sequence_parallel=True")
    for m in layers:
        m.collective_matmul = on
    return len(layers)


# -- what the timeline shows ----------------------------------------------------------------------------

def hidden_share(events) -> float:
    """Of one rank's traced events: the share of its hop ("send") time that ran while it computed."""
    comp = [(e["t0"], e["t1"]) for e in events if e["cat"] == "compute"]
    sends = [(e["t0"], e["t1"]) for e in events if e["cat"] == "send"]
    total = sum(t1 - t0 for t0, t1 in sends)
    hidden = sum(max(0.0, min(t1, c1) - max(t0, c0)) for t0, t1 in sends for c0, c1 in comp)
    return hidden / total if total > 0 else 0.0


def lanes(events, width: int = 96) -> str:
    """One rank's timeline in two rows: 'M' where it multiplies, '~' where a hop is on the link."""
    t0 = min(e["t0"] for e in events)
    span = max(e["t1"] for e in events) - t0 or 1.0
    rows = {"compute": [" "] * width, "send": [" "] * width}
    for e in events:
        if e["cat"] in rows:
            a, b = int((e["t0"] - t0) / span * width), int((e["t1"] - t0) / span * width)
            for i in range(a, max(a + 1, b)):
                rows[e["cat"]][min(i, width - 1)] = "M" if e["cat"] == "compute" else "~"
    return f"  compute |{''.join(rows['compute'])}|\n  link    |{''.join(rows['send'])}|"
