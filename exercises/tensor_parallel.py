"""Exercise 4: split one linear layer y = x @ w + b across the ranks of a tensor-parallel group.

Weights are (in_features, out_features), as everywhere in minidist. Column parallel splits w by
output features (axis 1): every rank computes its own block of y's columns, no communication.
Row parallel splits w by input features (axis 0): every rank multiplies its block of x's last axis
by its block of w's rows, and the partial products are summed by one all-reduce.

The forward functions are SPMD code for ONE rank: called on every rank of ``comm`` (``comm.rank``,
``comm.size``) with that rank's NumPy float64 arrays. Sum across ranks with
``all_reduce(comm, x)`` (imported below: the sum of every rank's x, on every rank).

Grade it:  python -m minidist.grade tensor_parallel
The grader runs your functions on 1..4 thread ranks, compares with the serial ``x @ w + b`` and
reads the ledger: column parallel sends nothing, row parallel exactly one all-reduce.
Lesson: lessons/04-tensor-parallel.md; minidist's answer is ColumnParallelLinear / RowParallelLinear
in minidist/parallel/tp_layers.py, so try before you look.
"""

import numpy as np  # noqa: F401  (you will need it)

from minidist.comm.collectives import all_reduce  # noqa: F401  (you will need it)


def shard_columns(w, rank, tp):
    """Rank ``rank``'s block of the last axis of ``w`` (a weight (in, out) or a bias (out,)), split
    into ``tp`` equal contiguous blocks in rank order: shards of ranks 0..tp-1 concatenated along
    the last axis give back w. The last axis is divisible by tp."""
    raise NotImplementedError


def shard_rows(w, rank, tp):
    """Rank ``rank``'s block of the FIRST axis of ``w`` (in, out): ``tp`` equal contiguous blocks in
    rank order, concatenated along axis 0 they give back w. The first axis is divisible by tp."""
    raise NotImplementedError


def column_parallel_forward(comm, x, w_shard, b_shard):
    """This rank's block of the output columns of ``x @ w + b``.

    x (..., in) is the full input, the same on every rank; ``w_shard = shard_columns(w, rank, tp)``
    (in, out/tp) and ``b_shard = shard_columns(b, rank, tp)`` (out/tp,). Returns (..., out/tp).
    Sends nothing: every rank already has all it needs.
    """
    raise NotImplementedError


def row_parallel_forward(comm, x_shard, w_shard, b):
    """The full ``x @ w + b``, on every rank.

    x_shard (..., in/tp) is this rank's block of x's last axis (what a column-parallel layer just
    produced), ``w_shard = shard_rows(w, rank, tp)`` (in/tp, out) and b (out,) is the full bias, the
    same on every rank. Returns (..., out). One all-reduce of the output; mind where the bias goes.
    """
    raise NotImplementedError
