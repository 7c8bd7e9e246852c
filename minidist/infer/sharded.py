"""Sharded serving: the same generation with the model split across ranks.

Tensor parallelism (Megatron-LM) inside each block, over the ``tp`` group: each rank serves with
training's own ``ParallelBlock`` holding exactly the shard it would train (loaded from the serial
block by the blocks' sharding table, ``load_shard``): qkv and fc column-parallel, the two output
projections row-parallel -- two all-reduces of (B, T, d) per layer per step -- and each rank's KV
cache holds only its own heads. The embedding and the head are replicated on the tp ranks.
Pipeline parallelism over the ``pp`` group: stage s holds a contiguous run of blocks (``stage_blocks``;
stage 0 the embedding, the last stage the head and the sampling); a step sends the hidden states
(B, T, d) from stage to stage, and the sampled tokens go back to every rank. The serial twin is
``generate`` in one process: the tokens must be the same.
"""

from __future__ import annotations

import numpy as np

from minidist.comm import Mesh
from minidist.infer.decoder import Decoder, forward_tokens, last_logits
from minidist.infer.generate import check_prompts, decode_loop, host
from minidist.infer.kv_cache import KVCache
from minidist.infer.sampling import GREEDY
from minidist.parallel.tensor.gpt import ParallelBlock
from minidist.parallel.tensor.sharding import load_shard
from minidist.trace.spans import span


def stage_blocks(n_layer: int, pp: int) -> list[tuple[int, int]]:
    """The (start, stop) blocks of each of ``pp`` stages: contiguous, the first ones one longer."""
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"number of stages must be an int >= 1, got {pp!r}")
    if pp > n_layer:
        raise ValueError(f"cannot cut {n_layer} layers into {pp} pipeline stages: every stage needs at "
                         f"least one layer; use at most {n_layer} stages (or a deeper model)")
    ends = np.cumsum([len(a) for a in np.array_split(np.arange(n_layer), pp)]).tolist()
    return list(zip([0, *ends[:-1]], ends))


def tp_block(cfg, block, tp_comm) -> ParallelBlock:
    """The ``ParallelBlock`` holding this rank's shard of the serial ``block`` (eval mode)."""
    shard = ParallelBlock(cfg, tp_comm, np.random.default_rng(0), backend=block.ln1.weight.backend)
    load_shard(shard, block.state_dict(), tp_comm.rank, tp_comm.size)  # replaces the random init
    return shard.eval()


def shard_for(mesh: Mesh, model) -> Decoder:
    """This rank's layers on ``mesh``: its pipeline stage's blocks, tensor-parallel over ``mesh.tp``;
    the embedding on the first stage, the head on the last."""
    cfg, layers = model.config, list(model)
    start, stop = stage_blocks(cfg.n_layer, mesh.pp_size)[mesh.pp_rank]
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
        stage_blocks(cfg.n_layer, pp)  # raises if pp > n_layer
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
        with span("prefill" if max(map(len, feed)) > 1 else "decode", "compute"):
            out = forward_tokens(dec, cache, active, feed, x=x)
        if not last:
            mesh.pp.send(out, mesh.pp_rank + 1)
            return None
        return host(last_logits(out, feed)) if mesh.tp_rank == 0 else None

    def agree(tokens):
        return comm.bcast_obj(tokens, root=sampler)

    return decode_loop(step, prompts, max_new_tokens, sampling, stop_tokens, return_logits, agree=agree,
                       vocab_size=cfg.vocab_size)
