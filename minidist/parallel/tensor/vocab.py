"""Vocabulary parallelism: the embedding table and the loss split along the vocabulary.

* ``VocabParallelEmbedding``: rank r holds rows [r·V/tp, (r+1)·V/tp) of the table; ids outside
  give zeros; the partial lookups are summed (all-reduce, or reduce-scatter under sequence parallel).
* ``vocab_parallel_cross_entropy``: the loss of vocabulary-sharded logits without gathering them:
  all-reduces of the row max, the target logit and the sum of exponentials -- 3 numbers a token.
"""

from __future__ import annotations

import numpy as np

from minidist.accel import compiled
from minidist.accel.backend import backend_of, host_scalar
from minidist.autograd import ops
from minidist.autograd.tensor import Function, Tensor
from minidist.nn.module import Module
from minidist.parallel.tensor.comm import (
    check_divisible,
    reduce_from_tp,
    reduce_scatter_to_seq,
    tp_all_reduce,
)
from minidist.parallel.tensor.shard import Shard
from minidist.parallel.tensor.shard_init import sharded_normal


def _ids(idx, be):
    """Integer ids (tokens, targets) as the layers below take them: a device array as it is; host ids
    stay on the host (on JAX: arguments of the compiled ops) except on CuPy, which won't mix them."""
    idx = idx.data if isinstance(idx, Tensor) else idx
    if be.is_array(idx):
        return idx
    return be.asarray(idx) if be.name == "cupy" else np.asarray(idx)


class VocabParallelEmbedding(Module):
    """Rows [start, start + V/tp) of the (V, h) table on each rank; lookups summed over the group."""

    def __init__(self, num_embeddings, dim, comm, sequence_parallel=False, *, dtype=np.float32, std=0.02,
                 rng=None, backend=None):
        super().__init__()
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.num_embeddings, self.local_rows = num_embeddings, check_divisible(comm, "vocab_size",
                                                                               num_embeddings)
        self.start = comm.rank * self.local_rows
        self.param_shards = {"weight": Shard(axis=0)}  # vocabulary rows
        self.weight = sharded_normal((num_embeddings, dim), std, dtype, comm, self.param_shards["weight"],
                                     rng, backend)

    def partial(self, idx):
        """My rows' contribution: embedding of ids in my range, zeros elsewhere."""
        be = self.weight.backend
        local = _ids(idx, be) - self.start
        xp = backend_of(local).xp  # (NumPy for ids on the host)
        outside = (local < 0) | (local >= self.local_rows)
        rows = ops.embedding(self.weight, xp.where(outside, 0, local))
        return rows * (~outside)[..., None].astype(self.weight.dtype)

    def forward(self, idx):
        part = self.partial(idx)
        if self.sequence_parallel:
            return reduce_scatter_to_seq(part, self.comm)
        return reduce_from_tp(part, self.comm)


class VocabParallelCrossEntropy(Function):
    """Mean cross-entropy of logits split along the vocabulary, (..., V/tp) on each rank:
    loss_i = log Σ_v exp(z_iv - m_i) - (z_i,t_i - m_i), m_i = max_v z_iv; m, the target logit and
    Σ exp are per-token all-reduces. Backward needs no communication: my slice of softmax(z) - onehot(t)."""

    @staticmethod
    def forward(ctx, logits, targets, comm, ignore_index=-1):
        v = logits.shape[-1]
        x = logits.reshape(-1, v)
        t = targets.reshape(-1)
        valid = t != ignore_index
        m = tp_all_reduce(comm, _row_max(x), op="max")
        local_t = t - comm.rank * v
        mine = valid & (local_t >= 0) & (local_t < v)
        safe_t = backend_of(t).xp.where(mine, local_t, 0)
        shifted, target, sum_exp = _shifted_target_sum_exp(x, m, safe_t, mine)
        target = tp_all_reduce(comm, target)
        lse = _log(tp_all_reduce(comm, sum_exp))
        n = max(int(valid.sum()), 1)
        ctx.save(shifted, lse)
        ctx.t, ctx.mine, ctx.valid, ctx.n, ctx.shape = safe_t, mine, valid, n, logits.shape
        return _mean_loss(lse, target, valid, host_scalar(n, lse), logits.dtype)

    @staticmethod
    def backward(ctx, g):
        shifted, lse = ctx.saved
        n = host_scalar(ctx.n, g)
        return _cross_entropy_grad(shifted, lse, ctx.t, ctx.mine, ctx.valid, g, n, ctx.shape), None


# The loss's array steps between its all-reduces, as pure functions: on NumPy as written, on JAX one
# compiled call each (``compiled.pure``) instead of an eager primitive -- and its program -- apiece.

@compiled.pure
def _row_max(x):
    return x.max(axis=-1)


@compiled.pure
def _shifted_target_sum_exp(x, m, safe_t, mine):
    """x - max, my part of each token's target logit (0 where the target is not in my slice), and
    my part of Σ exp."""
    xp = backend_of(x).xp
    shifted = x - m[:, None]
    return shifted, xp.take_along_axis(shifted, safe_t[:, None], axis=-1)[:, 0] * mine, \
        xp.exp(shifted).sum(axis=-1)


@compiled.pure
def _log(x):
    return backend_of(x).xp.log(x)


@compiled.pure
def _mean_loss(lse, target, valid, n, dtype):
    return (((lse - target) * valid).sum() / n).astype(dtype)


@compiled.pure
def _cross_entropy_grad(shifted, lse, t, mine, valid, g, n, shape):
    """My slice of softmax(z) - onehot(t), times g / n (ignored tokens: 0)."""
    be = backend_of(shifted)
    xp = be.xp
    probs = xp.exp(shifted - lse[:, None])
    rows = xp.arange(probs.shape[0])
    probs = be.scatter_add(probs, (rows, t), -mine.astype(probs.dtype))
    scale = (g / n) * valid[:, None].astype(probs.dtype)
    return (probs * scale).reshape(shape)


def vocab_parallel_cross_entropy(logits, targets, comm, ignore_index=-1):
    """The serial ``ops.cross_entropy`` of the full logits, from this rank's vocabulary slice."""
    be = backend_of(logits.data if isinstance(logits, Tensor) else logits)
    return VocabParallelCrossEntropy.apply(logits, _ids(targets, be), comm=comm, ignore_index=ignore_index)
