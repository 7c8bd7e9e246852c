"""The tensor-parallel layers (Megatron-LM), built on the conjugate functions of ``tp_comm``.

* ``ColumnParallelLinear``: y_r = f(x) @ W[:, cols_r] + b[cols_r] -- my block of output features.
* ``RowParallelLinear``: y = g(x_r @ W[rows_r, :]) + b -- partial products summed over the group.
* ``ParallelMLP``: column-parallel fc (4h/tp features per rank) -> GELU -> row-parallel proj.
* ``ParallelAttention``: the fused qkv projection column-parallel *by heads* (rank r holds heads
  r·H/tp .. (r+1)·H/tp of q, k and v), attention on local heads, row-parallel output projection.
* ``VocabParallelEmbedding``: rank r holds rows [r·V/tp, (r+1)·V/tp) of the table; ids outside
  give zeros; the partial lookups are summed (all-reduce, or reduce-scatter under sequence parallel).
* ``vocab_parallel_cross_entropy``: the loss of vocabulary-sharded logits without gathering them:
  all-reduces of the row max, the target logit and the sum of exponentials -- 3 numbers a token.
* Dropout RNG (Megatron's tracker): in replicated regions every rank of the group draws the same
  mask from the default generator (seeded alike). In sharded regions -- under sequence parallelism,
  dropout acts on sequence shards -- ``SequenceParallelDropout`` gives each rank a different mask:
  by default the rank's slice of the full mask drawn from the shared generator (mode "twin", named
  after the serial twin whose masks it reproduces: results don't depend on tp and equal the serial
  model's); or, with a ``ShardedRNG``, masks from a per-rank generator (Megatron's way: no wasted
  draws, but results depend on tp).

Every layer declares how its parameters are split, as data: ``param_shards`` maps a parameter's
name to a ``minidist.parallel.tensor.sharding.Shard`` (unlisted: replicated). Initialisation draws the
*full* weight from the same generator, in the same order, as the serial twin (``minidist.nn``)
and keeps this rank's part by that same Shard, so a tensor-parallel model equals the serial one
exactly, and ``sharding_table`` converts between the two.
"""

from __future__ import annotations

import numpy as np

from minidist.accel import jax_engine
from minidist.accel.backend import backend_of, default_backend, get_backend, host_scalar
from minidist.autograd import ops
from minidist.autograd import random as mrandom
from minidist.autograd.tensor import Function, Tensor
from minidist.nn.attention import self_attention
from minidist.nn.layers import Dropout
from minidist.nn.module import Module, Parameter
from minidist.parallel.tensor.collective_matmul import all_gather_matmul, check_overlap, matmul_reduce_scatter
from minidist.parallel.tensor.comm import (
    SEQ_AXIS,
    all_reduce_grad_hook,
    check_divisible,
    copy_to_tp,
    gather_from_seq,
    gather_last_dim,
    reduce_from_tp,
    reduce_scatter_to_seq,
    scatter_last_dim,
    tp_all_reduce,
)
from minidist.parallel.tensor.sharding import Shard


def sharded_normal(shape, std, dtype, comm, shard: Shard, rng=None, backend=None) -> Parameter:
    """Draw the full (serial) weight from ``rng`` on the host, keep this rank's ``shard`` of it."""
    rng = rng if rng is not None else mrandom.default_generator()
    full = get_backend("numpy").random_normal(rng, shape, dtype, scale=std)  # as Backend.random_normal
    be = get_backend(backend) if backend is not None else default_backend()
    return Parameter(be.from_host(np.array(shard.split(full, comm.rank, comm.size), order="C")))


def _zeros(n, dtype, backend) -> Parameter:
    be = get_backend(backend) if backend is not None else default_backend()
    return Parameter(be.from_host(np.zeros((n,), dtype=dtype)))


# -- the two parallel linear layers -----------------------------------------------------------------

class ColumnParallelLinear(Module):
    """y_r = f(x) @ W[:, cols_r] + b[cols_r]: each rank computes its block of output features.

    ``gather_output=True`` all-gathers y along the last axis (the full output on every rank);
    otherwise y stays split, ready for a ``RowParallelLinear``. ``sequence_parallel=True``: x is
    a sequence shard, all-gathered first (f becomes ``gather_from_seq``); with ``collective_matmul``
    the gather is decomposed into ring steps hidden behind the GEMM (``collective_matmul.py``).
    ``blocks=3``: the output is q|k|v side by side, and this rank keeps its columns of each (the
    attention's heads).
    """

    def __init__(self, in_features, out_features, comm, bias=True, gather_output=False,
                 sequence_parallel=False, *, blocks=1, dtype=np.float32, std=None, rng=None, backend=None,
                 collective_matmul=False):
        super().__init__()
        local = check_divisible(comm, "out_features", out_features)
        self.collective_matmul = check_overlap(comm, collective_matmul, sequence_parallel)
        std = (1.0 / np.sqrt(in_features)) if std is None else std
        self.comm, self.gather_output, self.sequence_parallel = comm, gather_output, sequence_parallel
        self.in_features, self.out_features, self.local_out = in_features, out_features, local
        self.param_shards = {"weight": Shard(axis=1, blocks=blocks)}  # output features
        self.weight = sharded_normal((in_features, out_features), std, dtype, comm,
                                     self.param_shards["weight"], rng, backend)
        self.bias = _zeros(local, dtype, backend) if bias else None
        if bias:
            self.param_shards["bias"] = Shard(axis=0, blocks=blocks)

    def forward(self, x):
        if self.collective_matmul:
            y = all_gather_matmul(x, self.weight, self.bias, self.comm)
        else:
            x = gather_from_seq(x, self.comm) if self.sequence_parallel else copy_to_tp(x, self.comm)
            y = ops.linear(x, self.weight, self.bias)  # this rank's block of output features
        return gather_last_dim(y, self.comm) if self.gather_output else y


class RowParallelLinear(Module):
    """y = g(x_r @ W[rows_r, :]) + b: each rank multiplies its block of input features; the
    partial products are summed by an all-reduce (or reduce-scattered along the sequence).

    ``input_is_parallel=False``: x is full and this rank first keeps its slice. The bias is
    replicated and added once, after the reduction. ``collective_matmul``: the reduce-scatter is
    decomposed into ring steps hidden behind the GEMM (sequence parallel only).
    """

    def __init__(self, in_features, out_features, comm, bias=True, input_is_parallel=True,
                 sequence_parallel=False, *, dtype=np.float32, std=None, rng=None, backend=None,
                 collective_matmul=False):
        super().__init__()
        self.local_in = check_divisible(comm, "in_features", in_features)
        self.collective_matmul = check_overlap(comm, collective_matmul, sequence_parallel)
        std = (1.0 / np.sqrt(in_features)) if std is None else std
        self.comm, self.input_is_parallel, self.sequence_parallel = comm, input_is_parallel, sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        self.param_shards = {"weight": Shard(axis=0)}  # input features; the bias is replicated
        self.weight = sharded_normal((in_features, out_features), std, dtype, comm,
                                     self.param_shards["weight"], rng, backend)
        self.bias = _zeros(out_features, dtype, backend) if bias else None
        if bias and sequence_parallel:
            all_reduce_grad_hook(self.bias, comm)

    def forward(self, x):
        if not self.input_is_parallel:
            x = scatter_last_dim(x, self.comm)
        if self.collective_matmul:
            y = matmul_reduce_scatter(x, self.weight, self.comm)
        else:
            y = ops.linear(x, self.weight)  # this rank's partial product, before the reduction
            reduce = reduce_scatter_to_seq if self.sequence_parallel else reduce_from_tp
            y = reduce(y, self.comm)
        return y if self.bias is None else y + self.bias



# -- dropout in sharded regions -----------------------------------------------------------------------


class ShardedRNG:
    """Megatron's model-parallel RNG: one generator per tensor-parallel rank, for sharded regions.

    ``with tracker.fork(): ...`` makes it this rank's default generator inside the block (and leaves
    the replicated-region generator untouched, so all ranks keep drawing the same masks there).
    """

    OFFSET = 2718  # Megatron adds 2718 + tp_rank to the seed

    def __init__(self, seed: int, tp_rank: int):
        self.generator = np.random.default_rng([seed, self.OFFSET, tp_rank])

    def fork(self):
        return mrandom.fork(self.generator)


class SliceOfFullDropout(ops.Dropout):
    """Dropout whose mask is my slice (along ``axis``) of the full mask ``rng`` would draw for the
    serial model: the same numbers as ``ops.Dropout``, whatever the split. Backward is ``ops.Dropout``'s."""

    @staticmethod
    def forward(ctx, x, p, rng, axis, rank, size):
        shape = list(x.shape)
        shape[axis] *= size
        mine = np.split(ops.dropout_mask(shape, p, rng, x.dtype), size, axis=axis)[rank]
        mask = backend_of(x).from_host(np.ascontiguousarray(mine))
        ctx.save(mask)
        return x * mask


class SequenceParallelDropout(Dropout):
    """Dropout on a sequence shard (B, T/tp, C): the serial twin's masks ("twin", the default) or
    ``sharded_rng``'s."""

    def __init__(self, p, comm, sharded_rng: ShardedRNG | None = None):
        super().__init__(p)
        self.comm, self.sharded_rng = comm, sharded_rng

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        if self.sharded_rng is not None:
            with self.sharded_rng.fork() as gen:
                return ops.dropout(x, self.p, gen, True)
        return SliceOfFullDropout.apply(x, p=self.p, rng=mrandom.default_generator(), axis=SEQ_AXIS,
                                        rank=self.comm.rank, size=self.comm.size)


def make_dropout(p, comm, sequence_parallel: bool, sharded_rng=None):
    """Plain (replicated-region) dropout, or the sequence-parallel one."""
    return SequenceParallelDropout(p, comm, sharded_rng) if sequence_parallel else Dropout(p)


# -- MLP and attention ----------------------------------------------------------------------------------


class ParallelMLP(Module):
    """Linear(h, 4h) column-parallel -> GELU (on local features, no communication) -> Linear(4h, h)
    row-parallel -> dropout. Forward: one all-reduce (in proj); backward: one (in fc's f)."""

    def __init__(self, dim, comm, hidden=None, dropout=0.0, sequence_parallel=False, *, dtype=np.float32,
                 std=0.02, proj_std=None, rng=None, backend=None, sharded_rng=None, collective_matmul=False):
        super().__init__()
        hidden = hidden or 4 * dim
        kw = dict(dtype=dtype, rng=rng, backend=backend, collective_matmul=collective_matmul)
        self.fc = ColumnParallelLinear(dim, hidden, comm, sequence_parallel=sequence_parallel, std=std, **kw)
        self.proj = RowParallelLinear(hidden, dim, comm, sequence_parallel=sequence_parallel,
                                      std=proj_std or std, **kw)
        self.drop = make_dropout(dropout, comm, sequence_parallel, sharded_rng)

    def forward(self, x):
        return self.drop(self.proj(ops.gelu(self.fc(x))))


class ParallelAttention(Module):
    """Causal self-attention with the heads split across the group: n_head/tp heads per rank."""

    def __init__(self, dim, n_head, comm, dropout=0.0, sequence_parallel=False, *, dtype=np.float32,
                 std=0.02, proj_std=None, rng=None, backend=None, sharded_rng=None, collective_matmul=False):
        super().__init__()
        if dim % n_head:
            raise ValueError(f"rank {comm.rank}: d_model {dim} is not divisible by n_head {n_head}")
        self.n_head = n_head
        self.local_heads = check_divisible(comm, "n_head", n_head)
        kw = dict(dtype=dtype, rng=rng, backend=backend, sequence_parallel=sequence_parallel,
                  collective_matmul=collective_matmul)
        self.qkv = ColumnParallelLinear(dim, 3 * dim, comm, blocks=3, std=std, **kw)
        self.proj = RowParallelLinear(dim, dim, comm, std=proj_std or std, **kw)
        self.drop = make_dropout(dropout, comm, sequence_parallel, sharded_rng)

    def forward(self, x, cache=None):
        """``cache``: this layer's view of a KV cache holding this rank's heads (inference)."""
        if cache is not None and self.qkv.sequence_parallel:
            raise ValueError(f"rank {self.qkv.comm.rank}: a KV cache needs the whole sequence on every rank; "
                             "build the model with sequence_parallel=False to decode")
        return self.drop(self.proj(self_attention(self.qkv(x), self.local_heads, cache)))


# -- vocabulary parallel embedding and loss ---------------------------------------------------------------


def _ids(idx, be):
    """Integer ids (tokens, targets) as the layers below take them: the backend's device array as it
    is; host ids stay on the host except on CuPy, which won't mix host and device arrays. (On JAX the
    ops take host ids as arguments, and masks of host ids are host arithmetic: no compiled program,
    no read-back.)"""
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
    """Mean cross-entropy of logits split along the vocabulary: (..., V/tp) on each rank.

    loss_i = log Σ_v exp(z_iv - m_i) - (z_i,t_i - m_i) with m_i = max_v z_iv; each of m, the
    target logit and Σ exp is a per-token all-reduce over the group. Backward needs no
    communication: my slice of softmax(z) - onehot(t).
    """

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
# compiled call each (``jax_engine.pure``) instead of an eager primitive -- and its program -- apiece.

@jax_engine.pure
def _row_max(x):
    return x.max(axis=-1)


@jax_engine.pure
def _shifted_target_sum_exp(x, m, safe_t, mine):
    """x - max, my part of each token's target logit (0 where the target is not in my slice), and
    my part of Σ exp."""
    xp = backend_of(x).xp
    shifted = x - m[:, None]
    return shifted, xp.take_along_axis(shifted, safe_t[:, None], axis=-1)[:, 0] * mine, \
        xp.exp(shifted).sum(axis=-1)


@jax_engine.pure
def _log(x):
    return backend_of(x).xp.log(x)


@jax_engine.pure
def _mean_loss(lse, target, valid, n, dtype):
    return (((lse - target) * valid).sum() / n).astype(dtype)


@jax_engine.pure
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
