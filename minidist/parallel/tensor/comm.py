"""The conjugate communication functions of tensor parallelism (Megatron-LM), and nothing else.

Each moves activations between the ranks of the tensor-parallel group ``comm`` (always passed in)
and is an autograd ``Function`` whose backward is the *conjugate* of its forward:

==========================  ===========================  ============================
function                    forward                      backward
==========================  ===========================  ============================
``copy_to_tp``   (f)        identity                     all-reduce
``reduce_from_tp`` (g)      all-reduce                   identity
``gather_last_dim``         all-gather along the last    keep my slice
``scatter_last_dim``        keep my slice                all-gather
``scatter_to_seq``          keep my sequence slice       all-gather along the sequence
``gather_from_seq``         all-gather along sequence    reduce-scatter along sequence
``reduce_scatter_to_seq``   reduce-scatter along seq.    all-gather along the sequence
==========================  ===========================  ============================

A column-parallel linear starts with f, a row-parallel one ends with g (``layers.py``); sequence
parallelism swaps them for ``gather_from_seq`` and ``reduce_scatter_to_seq``: the same bytes.
"""

from __future__ import annotations

from minidist.autograd.tensor import Function
from minidist.comm import all_gather as comm_all_gather
from minidist.comm import reduce_scatter, ring_all_reduce

ALGORITHM = "ring"  # all-reduce algorithm of the tensor-parallel group: 2(p-1)/p·N bytes per rank
SEQ_AXIS = 1        # activations are (batch, sequence, hidden)


def check_divisible(comm, what: str, n: int) -> int:
    """``n // comm.size``, or a ValueError naming the rank, the numbers and what would work."""
    p = comm.size
    if n % p:
        ok = [d for d in range(1, n + 1) if n % d == 0]
        raise ValueError(f"rank {comm.rank}: {what} = {n} is not divisible by the tensor-parallel size "
                         f"{p}; use a tp size in {ok} or change {what}")
    return n // p


def _slice(x, comm, axis: int):
    """My equal part of x along ``axis`` (raises if it doesn't divide)."""
    axis = axis % x.ndim
    n = check_divisible(comm, f"axis {axis} of an activation of shape {tuple(x.shape)}", x.shape[axis])
    idx = (slice(None),) * axis + (slice(comm.rank * n, (comm.rank + 1) * n),)
    return x[idx]


def tp_all_reduce(comm, x, op: str = "sum"):
    """The ring all-reduce (``ALGORITHM``) over the tensor-parallel group (free for one rank)."""
    return x if comm.size == 1 else ring_all_reduce(comm, x, op=op)


def all_gather(comm, x, axis: int):
    """The group's equal-shaped x concatenated along ``axis`` (the ring, without shape headers)."""
    return comm_all_gather(comm, x, axis=axis, sizes="equal")


# -- the conjugate functions ------------------------------------------------------------------------

class CopyToTP(Function):
    """f: identity forward, all-reduce backward (each rank's input gradient is a partial sum)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx, g):
        return tp_all_reduce(ctx.comm, g)


class ReduceFromTP(Function):
    """g: all-reduce forward (sum the ranks' partial outputs), identity backward."""

    @staticmethod
    def forward(ctx, x, comm):
        return tp_all_reduce(comm, x)

    @staticmethod
    def backward(ctx, g):
        return g


class GatherAxis(Function):
    """All-gather along ``axis`` forward; backward keeps my slice of the gradient."""

    @staticmethod
    def forward(ctx, x, comm, axis):
        ctx.comm, ctx.axis = comm, axis
        return x if comm.size == 1 else all_gather(comm, x, axis=axis % x.ndim)

    @staticmethod
    def backward(ctx, g):
        return _slice(g, ctx.comm, ctx.axis)


class ScatterAxis(Function):
    """Keep my slice along ``axis`` forward; backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x, comm, axis):
        ctx.comm, ctx.axis = comm, axis
        return _slice(x, comm, axis)

    @staticmethod
    def backward(ctx, g):
        return g if ctx.comm.size == 1 else all_gather(ctx.comm, g, axis=ctx.axis % g.ndim)


class GatherFromSeq(Function):
    """Sequence parallel entry to a column-parallel layer: all-gather the sequence forward,
    reduce-scatter it backward (the gradient of the full sequence is a partial sum per rank)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x if comm.size == 1 else all_gather(comm, x, axis=SEQ_AXIS)

    @staticmethod
    def backward(ctx, g):
        c = ctx.comm
        _slice(g, c, SEQ_AXIS)  # check divisibility first: a clear error, not uneven chunks
        return g if c.size == 1 else reduce_scatter(c, g, axis=SEQ_AXIS)


class ReduceScatterToSeq(Function):
    """Sequence parallel exit of a row-parallel layer: reduce-scatter forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        _slice(x, comm, SEQ_AXIS)
        return x if comm.size == 1 else reduce_scatter(comm, x, axis=SEQ_AXIS)

    @staticmethod
    def backward(ctx, g):
        return g if ctx.comm.size == 1 else all_gather(ctx.comm, g, axis=SEQ_AXIS)


for _op in (CopyToTP, ReduceFromTP, GatherAxis, ScatterAxis, GatherFromSeq, ReduceScatterToSeq):
    _op.priced_elsewhere = True  # a device model charges no compute for them: the link prices them


def copy_to_tp(x, comm):
    return CopyToTP.apply(x, comm=comm)


def reduce_from_tp(x, comm):
    return ReduceFromTP.apply(x, comm=comm)


def gather_last_dim(x, comm):
    return GatherAxis.apply(x, comm=comm, axis=-1)


def scatter_last_dim(x, comm):
    return ScatterAxis.apply(x, comm=comm, axis=-1)


def scatter_to_seq(x, comm):
    return ScatterAxis.apply(x, comm=comm, axis=SEQ_AXIS)


def gather_from_seq(x, comm):
    return GatherFromSeq.apply(x, comm=comm)


def reduce_scatter_to_seq(x, comm):
    return ReduceScatterToSeq.apply(x, comm=comm)


def all_reduce_grad_hook(param, comm):
    """Sequence parallelism: a replicated parameter (LayerNorm, row-parallel bias, position table)
    used on sequence shards gets a partial gradient on each rank; sum it over the group, before it
    is accumulated (so gradient accumulation over micro-batches stays right)."""
    if comm.size > 1:
        param.register_hook(lambda g: tp_all_reduce(comm, g))
    return param
