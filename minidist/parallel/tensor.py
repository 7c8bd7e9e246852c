"""Tensor parallelism as in Megatron-LM: one layer's weight matrices split across a group of ranks.

Everything is built from a few *conjugate* autograd functions that move activations between the
ranks of the tensor-parallel group ``comm`` (principle 1: the group is always passed in):

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

``ColumnParallelLinear`` (weight split by output features, minidist weights are (in, out): axis 1)
starts with f; ``RowParallelLinear`` (split by input features: axis 0) ends with g. Column then
row -- the MLP, or attention with heads split across ranks -- costs one all-reduce forward and one
backward. Sequence parallelism swaps f for ``gather_from_seq`` and g for ``reduce_scatter_to_seq``:
the same bytes, but what lies between the blocks (LayerNorm, dropout, residual) is on sequence
shards, 1/tp of the activations per rank.

Sharded initialisation: each layer draws the *full* weight from the same generator, in the same
order, as its serial twin (``minidist.nn``) and keeps its slice, so a tensor-parallel model equals
the serial one exactly. ``split_rows``, ``split_columns`` and ``split_qkv`` are the slicing rules,
written once and used again by ``minidist.parallel.tp_gpt.shard_state_dict``.

The layers (MLP, attention, vocabulary-parallel embedding and loss, dropout) are in
``minidist.parallel.tp_layers`` and re-exported here.
"""

from __future__ import annotations

import numpy as np

from minidist import ops
from minidist.backend import default_backend, get_backend
from minidist.comm import all_gather as comm_all_gather
from minidist.comm import all_reduce, reduce_scatter
from minidist.nn.module import Module, Parameter
from minidist.tensor import Function

ALGORITHM = "ring"  # all-reduce algorithm of the tensor-parallel group: 2(p-1)/p·N bytes per rank
SEQ_AXIS = 1        # activations are (batch, sequence, hidden)


# -- checks -----------------------------------------------------------------------------------------

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
    """All-reduce over the tensor-parallel group (free when the group has one rank)."""
    return x if comm.size == 1 else all_reduce(comm, x, op=op, algorithm=ALGORITHM)


def all_gather(comm, x, axis: int):
    """Concatenate the group's equal-shaped x along ``axis``: ``minidist.comm.all_gather`` told the
    parts are equal, so a ring on raw buffers without shape headers ((p-1)/p·N bytes, p-1 steps)."""
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


# -- slicing rules: full weight <-> this rank's shard ------------------------------------------------

def split_rows(a, rank: int, p: int):
    n = a.shape[0] // p
    return a[rank * n:(rank + 1) * n]


def split_columns(a, rank: int, p: int):
    n = a.shape[-1] // p
    return a[..., rank * n:(rank + 1) * n]


def split_qkv(a, rank: int, p: int):
    """The last axis is [q | k | v], each with heads contiguous: take my block of heads of each."""
    *lead, three_c = a.shape
    c = three_c // 3
    return split_columns(a.reshape(*lead, 3, c), rank, p).reshape(*lead, 3 * (c // p))


def concat_rows(parts):
    return np.concatenate(parts, axis=0)


def concat_columns(parts):
    return np.concatenate(parts, axis=-1)


def concat_qkv(parts):
    *lead, three_cp = parts[0].shape
    blocks = [p.reshape(*lead, 3, three_cp // 3) for p in parts]
    full = np.concatenate(blocks, axis=-1)
    return full.reshape(*lead, 3 * full.shape[-1])


def sharded_normal(shape, std, dtype, rank, p, split, rng=None, backend=None) -> Parameter:
    """Draw the full (serial) weight from ``rng`` on the host, keep this rank's ``split`` of it."""
    from minidist import random as mrandom

    rng = rng if rng is not None else mrandom.default_generator()
    full = get_backend("numpy").random_normal(rng, shape, dtype, scale=std)  # as Backend.random_normal
    be = get_backend(backend) if backend is not None else default_backend()
    return Parameter(be.from_host(np.ascontiguousarray(split(full, rank, p))))


def _zeros(n, dtype, backend) -> Parameter:
    be = get_backend(backend) if backend is not None else default_backend()
    return Parameter(be.from_host(np.zeros((n,), dtype=dtype)))


# -- the two parallel linear layers -----------------------------------------------------------------

class ColumnParallelLinear(Module):
    """y_r = f(x) @ W[:, cols_r] + b[cols_r]: each rank computes its block of output features.

    ``gather_output=True`` all-gathers y along the last axis (the full output on every rank);
    otherwise y stays split, ready for a ``RowParallelLinear``. ``sequence_parallel=True``: x is
    a sequence shard, all-gathered first (f becomes ``gather_from_seq``). ``split`` says which
    output columns are mine (``split_qkv`` for the attention's fused q, k, v projection).
    """

    def __init__(self, in_features, out_features, comm, bias=True, gather_output=False,
                 sequence_parallel=False, *, split=split_columns, dtype=np.float32, std=None, rng=None,
                 backend=None):
        super().__init__()
        local = check_divisible(comm, "out_features", out_features)
        std = (1.0 / np.sqrt(in_features)) if std is None else std
        self.comm, self.gather_output, self.sequence_parallel = comm, gather_output, sequence_parallel
        self.in_features, self.out_features, self.local_out = in_features, out_features, local
        self.weight = sharded_normal((in_features, out_features), std, dtype, comm.rank, comm.size, split,
                                     rng, backend)
        self.bias = _zeros(local, dtype, backend) if bias else None

    def forward(self, x):
        x = gather_from_seq(x, self.comm) if self.sequence_parallel else copy_to_tp(x, self.comm)
        y = self._local(x)
        return gather_last_dim(y, self.comm) if self.gather_output else y

    def _local(self, x):
        """This rank's block of output features, bias included (``autocast`` swaps in a low-precision one)."""
        return ops.linear(x, self.weight, self.bias)


class RowParallelLinear(Module):
    """y = g(x_r @ W[rows_r, :]) + b: each rank multiplies its block of input features; the
    partial products are summed by an all-reduce (or reduce-scattered along the sequence).

    ``input_is_parallel=False``: x is full and this rank first keeps its slice. The bias is
    replicated and added once, after the reduction.
    """

    def __init__(self, in_features, out_features, comm, bias=True, input_is_parallel=True,
                 sequence_parallel=False, *, dtype=np.float32, std=None, rng=None, backend=None):
        super().__init__()
        self.local_in = check_divisible(comm, "in_features", in_features)
        std = (1.0 / np.sqrt(in_features)) if std is None else std
        self.comm, self.input_is_parallel, self.sequence_parallel = comm, input_is_parallel, sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        self.weight = sharded_normal((in_features, out_features), std, dtype, comm.rank, comm.size,
                                     split_rows, rng, backend)
        self.bias = _zeros(out_features, dtype, backend) if bias else None
        if bias and sequence_parallel:
            all_reduce_grad_hook(self.bias, comm)

    def forward(self, x):
        if not self.input_is_parallel:
            x = scatter_last_dim(x, self.comm)
        y = self._local(x)
        y = reduce_scatter_to_seq(y, self.comm) if self.sequence_parallel else reduce_from_tp(y, self.comm)
        return y if self.bias is None else self._add_bias(y)

    def _local(self, x):
        """This rank's partial product, before the reduction (``autocast`` swaps these two hooks)."""
        return ops.linear(x, self.weight)

    def _add_bias(self, y):
        return y + self.bias


from minidist.parallel.tp_layers import (  # noqa: E402  (the layers build on everything above)
    ParallelAttention,
    ParallelMLP,
    SequenceParallelDropout,
    ShardedRNG,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)

__all__ = [
    "ColumnParallelLinear", "ParallelAttention", "ParallelMLP", "RowParallelLinear",
    "SequenceParallelDropout", "ShardedRNG", "VocabParallelEmbedding", "all_reduce_grad_hook",
    "check_divisible", "concat_columns",
    "concat_qkv", "concat_rows", "copy_to_tp", "gather_from_seq", "gather_last_dim", "reduce_from_tp",
    "reduce_scatter_to_seq", "scatter_last_dim", "scatter_to_seq", "split_columns", "split_qkv",
    "split_rows", "tp_all_reduce", "vocab_parallel_cross_entropy",
]
