"""Collective matmul (async tensor parallelism): the sequence-parallel all-gather and reduce-scatter
decomposed into p ring steps, each multiplying the shard in hand while the next one travels.

* **all-gather, then matmul** (:func:`all_gather_matmul`, the column-parallel layer): at step s
  rank r holds rank (r-s)'s sequence shard, passes it on to r+1 and computes its rows of the output.
* **matmul, then reduce-scatter** (:func:`matmul_reduce_scatter`, the row-parallel layer): the
  partial sum for rank d starts at rank d+1 and walks the ring, each rank adding its part.

Each pattern's backward is the other one; dW is one GEMM over the whole sequence. The products and
the ring's summation order are the plain layers', so the results equal theirs (chapter 4 says when
bit for bit). It builds on tensor parallelism: :func:`use_collective_matmul` sets a built model's
sequence-parallel ``ColumnParallelLinear`` / ``RowParallelLinear`` layers to run these. Hops are
point-to-point on a private channel; under an emulated wall-clock link on the communicator's async
worker (a NIC sends while the CPU computes; the virtual clock just charges the link). Traced: "send"
spans per hop, "compute" per GEMM; a device model prices each GEMM chunk as it runs.
"""

from __future__ import annotations

import math

import numpy as np

from minidist.accel.backend import backend_of
from minidist.autograd import meter
from minidist.autograd.ops.elementwise import Add
from minidist.autograd.ops.matmul import Linear, Matmul, low_precision
from minidist.autograd.tensor import Function
from minidist.comm import start_async
from minidist.parallel.tensor.comm import SEQ_AXIS, check_divisible
from minidist.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from minidist.trace.spans import current, span

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
        self.be, self.what, self.tracer = backend_of(x), what, current()
        host = np.ascontiguousarray(self.be.to_host(x))
        clock = self.tracer.now if self.tracer is not None else None
        if comm.link is not None and comm.clock is None:  # a wall-clock link sleeps: not on this thread
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
        with span(f"mm{src}", "compute"):
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
            with span("mm dW", "compute"):
                beside()
        with span(f"mm{(r - s - 1) % p}", "compute"):
            part = partial((r - s - 1) % p)
        if hop is not None:
            part = _add(part, hop.wait())
        if s == p - 1:
            if p == 1 and beside is not None:
                beside()
            return part
        hop = Hop(comm, part, what)


# -- products and chunks, as ``ops.Linear`` computes them -------------------------------------------

def _metered(op, ins, out):
    """``out``, with the op meter told (a device model prices each chunk as it runs, between hops)."""
    if meter.METER is not None:
        meter.METER(op, ins, out, False)
    return out


def _product(x, w):
    """x (..., k) @ w (k, n) as one 2-D GEMM of the rows (``ops.Linear``'s way)."""
    y = (x.reshape(math.prod(x.shape[:-1]), x.shape[-1]) @ w).reshape(x.shape[:-1] + w.shape[1:])
    return _metered(Linear, (x, w), y)


def _chunk(x, i: int, t: int):
    return x[:, i * t:(i + 1) * t]


def _sum_rows(g):
    rows = g.reshape(math.prod(g.shape[:-1]), g.shape[-1])
    return _metered(Add, (rows,), backend_of(g).xp.ones(rows.shape[0], dtype=g.dtype) @ rows)


def _weight_grad(x, g):
    xt = x.reshape(-1, x.shape[-1]).T
    return _metered(Matmul, (xt, g), xt @ g.reshape(-1, g.shape[-1]))


def _add(a, b):
    return _metered(Add, (a, b), a + b)


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

    priced_elsewhere = True  # each chunk's GEMM tells the op meter as it runs (_product)

    @staticmethod
    def forward(ctx, x, w, b=None, comm=None):
        _check(x, w, comm, "all_gather_matmul", sharded=True)
        p, xp = comm.size, backend_of(x).xp
        shards, outs = [None] * p, [None] * p

        def compute(src, xs):
            shards[src], outs[src] = xs, _product(xs, w) if b is None else _add(_product(xs, w), b)

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

    priced_elsewhere = True

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


def all_gather_matmul(x, w, b, comm):
    """The column-parallel layer's ``linear(gather_from_seq(x), w, b)``, overlapped."""
    return AllGatherMatmul.apply(x, w, comm=comm) if b is None else AllGatherMatmul.apply(x, w, b, comm=comm)


def matmul_reduce_scatter(x, w, comm):
    """The row-parallel layer's ``reduce_scatter_to_seq(linear(x, w))``, overlapped."""
    return MatmulReduceScatter.apply(x, w, comm=comm)


def use_collective_matmul(model, on: bool = True) -> int:
    """Switch every sequence-parallel Column/RowParallelLinear in ``model`` (itself such a layer, or
    a model holding them) to collective matmul, or back (``on=False``); returns how many layers
    were switched. Raises if the model has none."""
    layers = [m for _, m in model.named_modules()
              if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.sequence_parallel]
    if not layers:
        raise ValueError("use_collective_matmul: the model has no sequence-parallel tensor-parallel layer "
                         "(collective_matmul=True overlaps the sequence-parallel all-gather and "
                         "reduce-scatter); build it with sequence_parallel=True")
    for m in layers:
        if not on:
            m.collective_matmul = None
        elif isinstance(m, ColumnParallelLinear):
            m.collective_matmul = all_gather_matmul
        else:
            m.collective_matmul = matmul_reduce_scatter
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
