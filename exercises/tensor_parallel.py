"""Exercise 4: split one linear layer y = x @ w + b across the ranks of a tensor-parallel group.

Weights are (in_features, out_features), as everywhere in minidist. Column parallel splits w by
output features (axis 1): every rank computes its own block of y's columns, no communication.
Row parallel splits w by input features (axis 0): every rank multiplies its block of x's last axis
by its block of w's rows, and the partial products are summed by one all-reduce.

The forward functions are SPMD code for ONE rank: called on every rank of ``comm`` (``comm.rank``,
``comm.size``) with that rank's NumPy float64 arrays. Sum across ranks with
``all_reduce(comm, x)`` (imported below: the sum of every rank's x, on every rank).

Last, the loss over a vocabulary split across the ranks (Megatron's vocab-parallel cross-entropy):
the LM head is column parallel, so each rank holds only its slice of every row of logits, and the
full (N, V) logits are never gathered.

Estimated time: 1.5 h (shards 10 min, forwards 20 min, vocab-parallel cross-entropy 1 h)
Points: shard_columns 1, shard_rows 1, column_parallel_forward 2, row_parallel_forward 2,
vocab_parallel_cross_entropy 4.
Grade it:  python -m minidist.grade tensor_parallel
The grader runs your functions on 1..4 thread ranks, compares with the serial ``x @ w + b`` (and
the serial cross-entropy) and reads the ledger: column parallel sends nothing, row parallel exactly
one all-reduce, the cross-entropy a few all-reduces of N numbers and no gather of the logits.
Lesson: lessons/04-tensor-parallel.md; minidist's answer is ColumnParallelLinear / RowParallelLinear
in minidist/parallel/tensor/layers.py, so try before you look.
"""

import numpy as np  # noqa: F401  (you will need it)

from minidist.comm import all_reduce  # noqa: F401  (you will need it)


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
    Does not modify its inputs.
    """
    raise NotImplementedError


def row_parallel_forward(comm, x_shard, w_shard, b):
    """The full ``x @ w + b``, on every rank.

    x_shard (..., in/tp) is this rank's block of x's last axis (what a column-parallel layer just
    produced), ``w_shard = shard_rows(w, rank, tp)`` (in/tp, out) and b (out,) is the full bias, the
    same on every rank. Returns (..., out). One all-reduce of the output; mind where the bias goes.
    Does not modify its inputs.
    """
    raise NotImplementedError


def vocab_parallel_cross_entropy(comm, logits_shard, targets):
    """(loss, grad_shard): the mean cross-entropy of the full logits, and its gradient w.r.t. this
    rank's slice of them, without ever gathering the logits.

    logits_shard (N, V/tp) float64 is rank r's block of columns ``r*V/tp .. (r+1)*V/tp`` of the full
    logits (N, V); targets (N,) int are full-vocabulary ids, the same on every rank. The serial loss
    is ``mean_i( logsumexp(logits[i]) - logits[i, targets[i]] )``. Work it out with three all-reduces
    of N numbers each:
    * the row maximum (``all_reduce(comm, m, op="max")``), subtracted before exp so that logits of
      1000 do not overflow;
    * the sum of exp over the row (each rank sums its slice, then op="sum");
    * the target logit: only the rank whose slice holds ``targets[i]`` knows it; the others put 0.
    Return the loss (a float, the same on every rank) and ``grad_shard`` (N, V/tp): the gradient of
    the mean loss, ``(softmax(logits) - onehot(targets)) / N`` restricted to your columns.
    Does not modify its inputs.
    """
    raise NotImplementedError
