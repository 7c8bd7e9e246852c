"""A tensor-parallel GPT: ``minidist.nn.GPT``'s structure with every big matrix split over ``tp_comm``.

``TPGPT(cfg, tp_comm)`` is a ``Sequential`` of ``ParallelEmbed``, ``ParallelBlock`` x n_layer and
``ParallelHead``: the serial GPT's layers and parameter names (a pipeline cuts it into stages; a
serial state_dict maps onto it, ``sharding.py``), initialised from the serial GPT's draws: on tp
ranks it *is* GPT(cfg), split. Grouped-query attention splits the K/V heads when tp divides them,
else replicates them (``shard.kv_heads_split``). The head returns this rank's vocabulary slice of
the logits; ``loss`` never gathers them. ``sequence_parallel=True``: activations between the
parallel regions are sequence shards (B, T/tp, h), dropout there taking the serial model's masks
(``dropout_rng="serial"``) or a per-rank generator's (``"megatron"``).
"""

from __future__ import annotations

import numpy as np

from minidist.accel.backend import backend_of
from minidist.autograd import ops
from minidist.nn.gpt import token_ids
from minidist.nn.layers import Embedding, LayerNorm
from minidist.nn.module import Module, Sequential
from minidist.parallel.tensor.comm import (
    all_reduce_grad_hook,
    check_divisible,
    copy_to_tp,
    gather_from_seq,
    gather_last_dim,
    tp_all_reduce,
)
from minidist.parallel.tensor.dropout import ShardedRNG, make_dropout
from minidist.parallel.tensor.layers import (
    ColumnParallelLinear,
    ParallelAttention,
    ParallelMLP,
    RowParallelLinear,
)
from minidist.parallel.tensor.shard import Shard, kv_heads_split, kv_of_local_heads, local_kv_heads
from minidist.parallel.tensor.shard_init import _zeros, sharded_normal
from minidist.parallel.tensor.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy


class ParallelEmbed(Module):
    """Vocabulary-parallel token embedding + replicated position embedding -> dropout."""

    def __init__(self, cfg, comm, rng, backend=None, sequence_parallel=False, sharded_rng=None):
        super().__init__()
        dt = np.dtype(cfg.dtype)
        self.comm, self.sequence_parallel, self.block_size = comm, sequence_parallel, cfg.block_size
        self.wte = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, comm, sequence_parallel, dtype=dt,
                                          rng=rng, backend=backend)
        self.wpe = Embedding(cfg.block_size, cfg.d_model, dtype=dt, rng=rng, backend=backend)
        self.drop = make_dropout(cfg.dropout, comm, sequence_parallel, sharded_rng)
        if sequence_parallel:
            all_reduce_grad_hook(self.wpe.weight, comm)

    def forward(self, idx, start: int = 0):
        idx = token_ids(idx, start, self.block_size)
        t = idx.shape[1]
        if self.sequence_parallel:  # host positions, as ``minidist.nn.gpt.Embed`` (no program on JAX)
            n = check_divisible(self.comm, "sequence length (sequence parallelism)", t)
            pos = np.arange(start + self.comm.rank * n, start + (self.comm.rank + 1) * n)
        else:
            pos = np.arange(start, start + t)
        return self.drop(self.wte(idx) + self.wpe(pos))


class GroupedQKV(Module):
    """Grouped-query attention's q|k|v projection over tp: my query heads' columns and my K/V heads'
    (split), or all of them (replicated: the k|v gradient, each rank's own part, summed over tp)."""

    def __init__(self, dim, n_head, n_kv_head, comm, sequence_parallel=False, *, dtype, std, rng, backend):
        super().__init__()
        d, tp = dim // n_head, comm.size
        widths = (n_head * d, n_kv_head * d, n_kv_head * d)
        whole = () if kv_heads_split(n_head, n_kv_head, tp) else (1, 2)
        self.comm, self.sequence_parallel, self.q_cols = comm, sequence_parallel, n_head * d // tp
        self.param_shards = {"weight": Shard(1, widths=widths, whole=whole),
                             "bias": Shard(0, widths=widths, whole=whole)}
        self.weight = sharded_normal((dim, sum(widths)), std, dtype, comm, self.param_shards["weight"], rng,
                                     backend)
        self.bias = _zeros(self.param_shards["bias"].local_shape((sum(widths),), tp)[0], dtype, backend)
        if whole and tp > 1:
            for p in (self.weight, self.bias):
                p.register_hook(self.sum_kv_grad)

    def sum_kv_grad(self, g):
        q = self.q_cols
        xp = backend_of(g).xp
        return xp.concatenate([g[..., :q], tp_all_reduce(self.comm, g[..., q:].copy())], axis=-1)

    def forward(self, x):
        x = gather_from_seq(x, self.comm) if self.sequence_parallel else copy_to_tp(x, self.comm)
        return ops.linear(x, self.weight, self.bias)


class ParallelGroupedAttention(Module):
    """Causal grouped-query attention with n_head/tp query heads per rank and their K/V heads."""

    def __init__(self, cfg, comm, sequence_parallel=False, *, dtype, std=0.02, proj_std=None, rng=None,
                 backend=None, sharded_rng=None):
        super().__init__()
        h, k, tp = cfg.n_head, cfg.kv_heads, comm.size
        self.n_head, self.n_kv_head = h, k
        self.local_heads = check_divisible(comm, "n_head", h)
        self.local_kv_heads = local_kv_heads(h, k, tp)
        self.kv_of = kv_of_local_heads(h, k, tp, comm.rank)
        kw = dict(dtype=dtype, rng=rng, backend=backend)
        self.qkv = GroupedQKV(cfg.d_model, h, k, comm, sequence_parallel, std=std, **kw)
        self.proj = RowParallelLinear(cfg.d_model, cfg.d_model, comm, std=proj_std or std,
                                      sequence_parallel=sequence_parallel, **kw)
        self.drop = make_dropout(cfg.dropout, comm, sequence_parallel, sharded_rng)

    forward = ParallelAttention.forward  # over its local query heads and their K/V heads


class ParallelBlock(Module):
    """x + attn(ln1(x)), then + mlp(ln2(x)), attention and MLP tensor-parallel (``cache``: a KV
    cache's view of this rank's heads, for sharded inference)."""

    def __init__(self, cfg, comm, rng, backend=None, sequence_parallel=False, sharded_rng=None):
        super().__init__()
        dt = np.dtype(cfg.dtype)
        proj_std = 0.02 / np.sqrt(2 * cfg.n_layer)
        kw = dict(dtype=dt, proj_std=proj_std, rng=rng, backend=backend, sharded_rng=sharded_rng)
        self.ln1 = LayerNorm(cfg.d_model, dtype=dt, backend=backend)
        if getattr(cfg, "kv_heads", cfg.n_head) == cfg.n_head:
            self.attn = ParallelAttention(cfg.d_model, cfg.n_head, comm, cfg.dropout, sequence_parallel, **kw)
        else:
            self.attn = ParallelGroupedAttention(cfg, comm, sequence_parallel, **kw)
        self.ln2 = LayerNorm(cfg.d_model, dtype=dt, backend=backend)
        self.mlp = ParallelMLP(cfg.d_model, comm, dropout=cfg.dropout, sequence_parallel=sequence_parallel,
                               **kw)
        if sequence_parallel:
            for ln in (self.ln1, self.ln2):
                all_reduce_grad_hook(ln.weight, comm)
                all_reduce_grad_hook(ln.bias, comm)

    def forward(self, x, cache=None):
        x = x + self.attn(self.ln1(x), cache=cache)
        return x + self.mlp(self.ln2(x))


class ParallelHead(Module):
    """Final LayerNorm and the vocabulary-parallel LM head: returns my slice (B, T, V/tp) of logits."""

    def __init__(self, cfg, comm, rng, backend=None, sequence_parallel=False):
        super().__init__()
        dt = np.dtype(cfg.dtype)
        self.ln = LayerNorm(cfg.d_model, dtype=dt, backend=backend)
        self.proj = ColumnParallelLinear(cfg.d_model, cfg.vocab_size, comm, bias=False,
                                         sequence_parallel=sequence_parallel, dtype=dt, std=0.02, rng=rng,
                                         backend=backend)
        if sequence_parallel:
            all_reduce_grad_hook(self.ln.weight, comm)
            all_reduce_grad_hook(self.ln.bias, comm)

    def forward(self, x):
        return self.proj(self.ln(x))


def check_config(cfg, comm):
    """Every size tensor parallelism splits must divide by tp: clear errors, before any collective."""
    check_divisible(comm, "n_head", cfg.n_head)
    kv_heads_split(cfg.n_head, getattr(cfg, "kv_heads", cfg.n_head), comm.size)  # K/V: split or replicated
    check_divisible(comm, "vocab_size", cfg.vocab_size)
    check_divisible(comm, "d_model", cfg.d_model)


DROPOUT_RNGS = ("serial", "megatron")  # sequence-parallel dropout: the serial model's masks, or per rank


class TPGPT(Sequential):
    """The GPT of ``cfg`` split over the tensor-parallel group ``tp_comm``."""

    def __init__(self, cfg, tp_comm, sequence_parallel: bool = False, dropout_rng: str = "serial",
                 backend=None):
        super().__init__()
        dropout_rng = "serial" if dropout_rng == "twin" else dropout_rng  # (its former name)
        if dropout_rng not in DROPOUT_RNGS:
            raise ValueError(f"dropout_rng must be one of {DROPOUT_RNGS}, got {dropout_rng!r}")
        check_config(cfg, tp_comm)
        for k, v in (("config", cfg), ("comm", tp_comm), ("sequence_parallel", sequence_parallel)):
            object.__setattr__(self, k, v)
        sharded = ShardedRNG(cfg.seed, tp_comm.rank) if dropout_rng == "megatron" else None
        object.__setattr__(self, "sharded_rng", sharded)
        rng = np.random.default_rng(cfg.seed)  # the serial GPT's draws, in its order
        sp = sequence_parallel
        self.append(ParallelEmbed(cfg, tp_comm, rng, backend, sp, sharded))
        for _ in range(cfg.n_layer):
            self.append(ParallelBlock(cfg, tp_comm, rng, backend, sp, sharded))
        self.append(ParallelHead(cfg, tp_comm, rng, backend, sp))

    def loss_fn(self, local_logits, targets):
        """Mean cross-entropy from this rank's vocabulary slice of the logits (pipeline last stage)."""
        return vocab_parallel_cross_entropy(local_logits, targets, self.comm)

    def loss(self, idx, targets):
        return self.loss_fn(self(idx), targets)

    def logits(self, idx):
        """The full (B, T, V) logits on every rank (an all-gather of the vocabulary slices)."""
        return gather_last_dim(self(idx), self.comm)
