"""Sharded serving: the same generation with the model split across ranks.

Tensor parallelism (Megatron-LM) inside each block, over the ``tp`` group of ``tp`` ranks: each
rank serves with training's own ``ParallelBlock``, holding exactly the shard it would train
(its parameters loaded from the serial block by the blocks' sharding table, ``load_shard``):

    qkv    column-parallel: rank r keeps the q, k and v columns of heads r·H/tp .. (r+1)·H/tp
    proj   row-parallel:    the matching rows; partial products are all-reduced, then + bias
    fc     column-parallel: hidden units r·4d/tp .. (r+1)·4d/tp (GELU is elementwise: no talk)
    proj   row-parallel:    all-reduce, then + bias

Two all-reduces of (B, T, d) per layer per step; each rank's KV cache holds only its own heads
(1/tp of the cache). The embedding and the head are replicated on the tp ranks (so a step moves
nothing else). Pipeline parallelism over the ``pp`` group: stage s holds a contiguous run of
blocks (cut by ``partition_uniform``, as in training; stage 0 holds the embedding, the last
stage the head and the sampling); a decode step sends the hidden states (B, T, d) from stage to
stage, and the sampled tokens go back to every rank.

The serial twin is ``generate`` in one process: the tokens must be the same.
"""

from __future__ import annotations

import numpy as np

from minidist import trace
from minidist.comm import Mesh
from minidist.infer.decoder import Decoder, forward_tokens, last_logits
from minidist.infer.generate import check_prompts, decode_loop, host
from minidist.infer.kv_cache import KVCache
from minidist.infer.sampling import GREEDY
from minidist.parallel.pipeline.partition import partition_uniform
from minidist.parallel.tensor.gpt import ParallelBlock
from minidist.parallel.tensor.sharding import load_shard


def tp_block(cfg, block, tp_comm) -> ParallelBlock:
    """The ``ParallelBlock`` holding this rank's shard of the serial ``block`` (eval mode)."""
    shard = ParallelBlock(cfg, tp_comm, np.random.default_rng(0), backend=block.ln1.weight.backend)
    load_shard(shard, block.state_dict(), tp_comm.rank, tp_comm.size)  # replaces the random init
    return shard.eval()


def shard_for(mesh: Mesh, model) -> Decoder:
    """This rank's layers on ``mesh``: its pipeline stage's blocks, tensor-parallel over ``mesh.tp``;
    the embedding on the first stage, the head on the last."""
    cfg, layers = model.config, list(model)
    start, stop = partition_uniform(cfg.n_layer, mesh.pp_size)[mesh.pp_rank]
    blocks = layers[1 + start:1 + stop]
    if mesh.tp_size > 1:
        blocks = [tp_block(cfg, b, mesh.tp) for b in blocks]
    first, last = mesh.pp_rank == 0, mesh.pp_rank == mesh.pp_size - 1
    return Decoder(cfg, blocks, embed=layers[0] if first else None, head=layers[-1] if last else None,
                   tp=mesh.tp_size)


def sharded_generate(comm, model, prompts, max_new_tokens, sampling=GREEDY, stop_tokens=(), tp=1, pp=1,
                     return_logits=False):
    """``generate`` with the model split over ``comm`` as tp x pp ranks; every rank returns the tokens.

    Logits (with ``return_logits``) come back on the rank that samples: the last stage's tp rank 0.
    """
    cfg, who = model.config, f"rank {comm.rank}: "
    # every check before any communication: every rank raises the same clear error, none waits
    if cfg.n_head % tp:
        raise ValueError(f"{who}n_head {cfg.n_head} is not divisible by tp {tp}")
    try:
        partition_uniform(cfg.n_layer, pp)  # raises if pp > n_layer
    except ValueError as e:
        raise ValueError(f"{who}{e}") from None
    prompts = check_prompts(prompts, cfg.block_size, cfg.vocab_size, max_new_tokens, who)
    mesh = Mesh(comm, dp=1, pp=pp, tp=tp)
    dec = shard_for(mesh, model)
    cache = KVCache.for_decoder(dec, len(prompts), max(len(p) for p in prompts) + max_new_tokens)
    last = mesh.pp_rank == pp - 1
    sampler = mesh.rank_of(pp - 1, 0, 0)

    def step(active, feed):
        x = None if mesh.pp_rank == 0 else mesh.pp.recv(mesh.pp_rank - 1)
        tracer = trace.current()
        if tracer is None:
            out = forward_tokens(dec, cache, active, feed, x=x)
        else:
            with tracer.span("prefill" if max(map(len, feed)) > 1 else "decode", "compute"):
                out = forward_tokens(dec, cache, active, feed, x=x)
        if not last:
            mesh.pp.send(out, mesh.pp_rank + 1)
            return None
        return host(last_logits(out, feed)) if mesh.tp_rank == 0 else None

    def agree(tokens):
        return comm.bcast_obj(tokens, root=sampler)

    return decode_loop(step, prompts, max_new_tokens, sampling, stop_tokens, return_logits, agree=agree,
                       vocab_size=cfg.vocab_size)
