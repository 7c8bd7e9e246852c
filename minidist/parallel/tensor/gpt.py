"""A tensor-parallel GPT: ``minidist.nn.GPT``'s structure with every big matrix split over ``tp_comm``.

``TPGPT(cfg, tp_comm)`` is a ``Sequential`` of ``ParallelEmbed``, ``ParallelBlock`` × n_layer,
``ParallelHead`` -- the same layer list (and the same parameter names) as the serial GPT, so a
pipeline can cut it into stages and a serial state_dict maps onto it name by name. Its layers
(``minidist.parallel.tensor.layers``) declare how each parameter is split; ``sharding_table(model)``
(``minidist.parallel.tensor.sharding``) reads them:

=========================  =======================  ==========================================
parameter                  split                    declared by
=========================  =======================  ==========================================
``0.wte.weight`` (V, h)    vocabulary rows          ``VocabParallelEmbedding``: ``Shard(0)``
``i.attn.qkv.*`` (h, 3h)   heads of q, k and v      ``ColumnParallelLinear(blocks=3)``
``i.attn.proj.weight``     input rows (heads)       ``RowParallelLinear``: ``Shard(0)``
``i.mlp.fc.*`` (h, 4h)     output columns           ``ColumnParallelLinear``: ``Shard(1)``/``(0)``
``i.mlp.proj.weight``      input rows               ``RowParallelLinear`` (bias replicated)
``{L+1}.proj.weight``      vocabulary columns       ``ColumnParallelLinear`` (the LM head)
LayerNorms, ``0.wpe``      replicated               (nothing declared)
=========================  =======================  ==========================================

Initialisation draws the full weights from ``default_rng(cfg.seed)`` in the serial GPT's order and
keeps this rank's slices: TPGPT(cfg) on tp ranks *is* GPT(cfg), split. The head returns this
rank's vocabulary slice of the logits; ``loss`` uses ``vocab_parallel_cross_entropy`` (the full
logits are never gathered); ``logits(idx)`` gathers them for inspection or sampling.

``sequence_parallel=True``: between the blocks' parallel regions the activations are sequence shards
(B, T/tp, h); LayerNorm, dropout and the residual adds run on 1/tp of the tokens. Dropout follows
``minidist.parallel.tensor.layers`` (the serial twin's masks, "twin", by default, or
``dropout_rng="megatron"``: a per-rank ``ShardedRNG`` seeded from ``cfg.seed``). Seed the default
generator alike on every rank of the group (``minidist.autograd.random.manual_seed``):
replicated-region masks come from it.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from minidist.accel.backend import backend_of
from minidist.nn.gpt import token_ids
from minidist.nn.layers import Embedding, LayerNorm
from minidist.nn.module import Module, Sequential
from minidist.parallel.tensor.comm import all_reduce_grad_hook, check_divisible, gather_last_dim
from minidist.parallel.tensor.layers import (
    ColumnParallelLinear,
    ParallelAttention,
    ParallelMLP,
    ShardedRNG,
    VocabParallelEmbedding,
    make_dropout,
    vocab_parallel_cross_entropy,
)
from minidist.parallel.tensor.sharding import load_shard, sharding_table, unshard


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


class ParallelBlock(Module):
    """x + attn(ln1(x)), then + mlp(ln2(x)), with attention and MLP tensor-parallel. ``cache``: this
    layer's view of a KV cache of this rank's heads (sharded inference, ``minidist.infer.sharded``)."""

    def __init__(self, cfg, comm, rng, backend=None, sequence_parallel=False, sharded_rng=None):
        super().__init__()
        dt = np.dtype(cfg.dtype)
        proj_std = 0.02 / np.sqrt(2 * cfg.n_layer)
        kw = dict(dtype=dt, proj_std=proj_std, rng=rng, backend=backend, sharded_rng=sharded_rng)
        self.ln1 = LayerNorm(cfg.d_model, dtype=dt, backend=backend)
        self.attn = ParallelAttention(cfg.d_model, cfg.n_head, comm, cfg.dropout, sequence_parallel, **kw)
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
    check_divisible(comm, "vocab_size", cfg.vocab_size)
    check_divisible(comm, "d_model", cfg.d_model)


class TPGPT(Sequential):
    """The GPT of ``cfg`` split over the tensor-parallel group ``tp_comm``."""

    def __init__(self, cfg, tp_comm, sequence_parallel: bool = False, dropout_rng: str = "twin",
                 backend=None):
        super().__init__()
        if dropout_rng not in ("twin", "megatron"):
            raise ValueError(f"dropout_rng must be 'twin' or 'megatron', got {dropout_rng!r}")
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

    def serial_state_dict(self) -> OrderedDict:
        """The serial GPT's state_dict, assembled on every rank (small models: pickled all-gather)."""
        local = OrderedDict((k, backend_of(a).to_host(a)) for k, a in self.state_dict().items())
        return unshard(self.comm.allgather_obj(local), sharding_table(self))

    def load_serial_state_dict(self, serial_sd: dict):
        """Load this rank's part of the serial GPT's state_dict."""
        return load_shard(self, serial_sd, self.comm.rank, self.comm.size)
