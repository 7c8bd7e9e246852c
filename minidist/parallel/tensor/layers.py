"""The tensor-parallel layers (Megatron-LM), built on the conjugate functions of ``comm.py``.

* ``ColumnParallelLinear``: y_r = f(x) @ W[:, cols_r] + b[cols_r] -- my block of output features.
* ``RowParallelLinear``: y = g(x_r @ W[rows_r, :]) + b -- partial products summed over the group.
* ``ParallelMLP``: column-parallel fc (4h/tp features per rank) -> GELU -> row-parallel proj.
* ``ParallelAttention``: q|k|v column-parallel *by heads*, attention on local heads, row-parallel
  output projection.

Every layer declares how its parameters are split, as data (``param_shards``: name -> ``Shard``;
unlisted: replicated), and draws the *full* weight as the serial model does, keeping its part
(``shard_init.py``): a tensor-parallel model equals the serial one exactly. The vocabulary-parallel
embedding and loss are in ``vocab.py``, sequence-parallel dropout in ``dropout.py``.
"""

from __future__ import annotations

import numpy as np

from minidist.autograd import ops
from minidist.nn.attention import self_attention
from minidist.nn.module import Module
from minidist.parallel.tensor.comm import (
    all_reduce_grad_hook,
    check_divisible,
    copy_to_tp,
    gather_from_seq,
    gather_last_dim,
    reduce_from_tp,
    reduce_scatter_to_seq,
    scatter_last_dim,
)
from minidist.parallel.tensor.dropout import make_dropout
from minidist.parallel.tensor.shard import Shard
from minidist.parallel.tensor.shard_init import _zeros, sharded_normal

# -- the two parallel linear layers -----------------------------------------------------------------

class ColumnParallelLinear(Module):
    """y_r = f(x) @ W[:, cols_r] + b[cols_r]: each rank computes its block of output features.

    ``gather_output=True`` all-gathers y along the last axis (the full output on every rank);
    otherwise y stays split, ready for a ``RowParallelLinear``. ``sequence_parallel=True``: x is
    a sequence shard, all-gathered first (f becomes ``gather_from_seq``). ``blocks=3``: the output
    is q|k|v side by side, and this rank keeps its columns of each (the attention's heads).
    ``collective_matmul``: None, or ``(x, w, b, comm) -> y`` doing the gather and the GEMM in one
    (set by ``collective_matmul.use_collective_matmul``).
    """

    collective_matmul = None

    def __init__(self, in_features, out_features, comm, bias=True, gather_output=False,
                 sequence_parallel=False, *, blocks=1, dtype=np.float32, std=None, rng=None, backend=None):
        super().__init__()
        local = check_divisible(comm, "out_features", out_features)
        std = (1.0 / np.sqrt(in_features)) if std is None else std
        self.comm, self.gather_output, self.sequence_parallel = comm, gather_output, sequence_parallel
        self.in_features, self.out_features, self.local_out = in_features, out_features, local
        self.param_shards = {"weight": Shard(axis=1, blocks=blocks)}  # output features
        self.weight = sharded_normal((in_features, out_features), std, dtype, comm,
                                     self.param_shards["weight"], rng, backend)
        self.bias = _zeros(local, dtype, backend) if bias else None
        if bias:
            self.param_shards["bias"] = Shard(axis=0, blocks=blocks)

    def forward(self, x, product=None):
        """``product``: the GEMM, ``ops.linear`` unless a forward wrapper passes another (FP8)."""
        if self.collective_matmul is not None and product is None:
            y = self.collective_matmul(x, self.weight, self.bias, self.comm)
        else:
            x = gather_from_seq(x, self.comm) if self.sequence_parallel else copy_to_tp(x, self.comm)
            y = (product or ops.linear)(x, self.weight, self.bias)  # this rank's block of output features
        return gather_last_dim(y, self.comm) if self.gather_output else y


class RowParallelLinear(Module):
    """y = g(x_r @ W[rows_r, :]) + b: each rank multiplies its block of input features; the
    partial products are summed by an all-reduce (or reduce-scattered along the sequence).

    ``input_is_parallel=False``: x is full and this rank first keeps its slice. The bias is
    replicated and added once, after the reduction. ``collective_matmul``: None, or
    ``(x, w, comm) -> y`` doing the GEMM and the reduce-scatter in one (``collective_matmul.py``).
    """

    collective_matmul = None

    def __init__(self, in_features, out_features, comm, bias=True, input_is_parallel=True,
                 sequence_parallel=False, *, dtype=np.float32, std=None, rng=None, backend=None):
        super().__init__()
        self.local_in = check_divisible(comm, "in_features", in_features)
        std = (1.0 / np.sqrt(in_features)) if std is None else std
        self.comm, self.input_is_parallel, self.sequence_parallel = comm, input_is_parallel, sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        self.param_shards = {"weight": Shard(axis=0)}  # input features; the bias is replicated
        self.weight = sharded_normal((in_features, out_features), std, dtype, comm,
                                     self.param_shards["weight"], rng, backend)
        self.bias = _zeros(out_features, dtype, backend) if bias else None
        if bias and sequence_parallel:
            all_reduce_grad_hook(self.bias, comm)

    def forward(self, x, product=None):
        """``product``: the GEMM, ``ops.linear`` unless a forward wrapper passes another (FP8)."""
        if not self.input_is_parallel:
            x = scatter_last_dim(x, self.comm)
        if self.collective_matmul is not None and product is None:
            y = self.collective_matmul(x, self.weight, self.comm)
        else:
            y = (product or ops.linear)(x, self.weight)  # this rank's partial product, before the reduction
            reduce = reduce_scatter_to_seq if self.sequence_parallel else reduce_from_tp
            y = reduce(y, self.comm)
        return y if self.bias is None else y + self.bias


# -- MLP and attention ----------------------------------------------------------------------------------

class ParallelMLP(Module):
    """Linear(h, 4h) column-parallel -> GELU (on local features, no communication) -> Linear(4h, h)
    row-parallel -> dropout. Forward: one all-reduce (in proj); backward: one (in fc's f)."""

    def __init__(self, dim, comm, hidden=None, dropout=0.0, sequence_parallel=False, *, dtype=np.float32,
                 std=0.02, proj_std=None, rng=None, backend=None, sharded_rng=None):
        super().__init__()
        hidden = hidden or 4 * dim
        kw = dict(dtype=dtype, rng=rng, backend=backend)
        self.fc = ColumnParallelLinear(dim, hidden, comm, sequence_parallel=sequence_parallel, std=std, **kw)
        self.proj = RowParallelLinear(hidden, dim, comm, sequence_parallel=sequence_parallel,
                                      std=proj_std or std, **kw)
        self.drop = make_dropout(dropout, comm, sequence_parallel, sharded_rng)

    def forward(self, x):
        return self.drop(self.proj(ops.gelu(self.fc(x))))


class ParallelAttention(Module):
    """Causal self-attention with the heads split across the group: n_head/tp heads per rank."""

    local_kv_heads = kv_of = None  # grouped-query attention's K/V heads (``gpt.ParallelGroupedAttention``)

    def __init__(self, dim, n_head, comm, dropout=0.0, sequence_parallel=False, *, dtype=np.float32,
                 std=0.02, proj_std=None, rng=None, backend=None, sharded_rng=None):
        super().__init__()
        if dim % n_head:
            raise ValueError(f"rank {comm.rank}: d_model {dim} is not divisible by n_head {n_head}")
        self.n_head = n_head
        self.local_heads = check_divisible(comm, "n_head", n_head)
        kw = dict(dtype=dtype, rng=rng, backend=backend, sequence_parallel=sequence_parallel)
        self.qkv = ColumnParallelLinear(dim, 3 * dim, comm, blocks=3, std=std, **kw)
        self.proj = RowParallelLinear(dim, dim, comm, std=proj_std or std, **kw)
        self.drop = make_dropout(dropout, comm, sequence_parallel, sharded_rng)

    def forward(self, x, cache=None):
        """``cache``: this layer's view of a KV cache holding this rank's heads (inference)."""
        if cache is not None and self.qkv.sequence_parallel:
            raise ValueError(f"rank {self.qkv.comm.rank}: a KV cache needs the whole sequence on every rank; "
                             "build the model with sequence_parallel=False to decode")
        y = self_attention(self.qkv(x), self.local_heads, cache, self.local_kv_heads, self.kv_of)
        return self.drop(self.proj(y))


