"""Sharded serving: the same generation with the model split across ranks.

Tensor parallelism (Megatron-LM) inside each block, over the ``tp`` group of ``tp`` ranks:

    qkv    column-parallel: rank r keeps the q, k and v columns of heads r·H/tp .. (r+1)·H/tp
    proj   row-parallel:    the matching rows; partial products are all-reduced, then + bias
    fc     column-parallel: hidden units r·4d/tp .. (r+1)·4d/tp (GELU is elementwise: no talk)
    proj   row-parallel:    all-reduce, then + bias

Two all-reduces of (B, T, d) per layer per step; each rank's KV cache holds only its own heads
(1/tp of the cache). Pipeline parallelism over the ``pp`` group: stage s holds a contiguous run
of blocks (cut by ``partition_uniform``, as in training; stage 0 holds the embedding, the last
stage the head and the sampling); a decode step sends the hidden states (B, T, d) from stage to
stage, and the sampled tokens go back to every rank. Every rank builds the same GPT from the
same seed and keeps only its slices.

The serial twin is ``generate`` in one process: the tokens must be the same.
"""

from __future__ import annotations

from dataclasses import replace

from minidist import trace
from minidist.comm import Mesh, all_reduce
from minidist.infer.decoder import GPTWeights, forward_tokens, last_logits
from minidist.infer.generate import as_weights, check_prompts, decode_loop, host
from minidist.infer.kv_cache import KVCache
from minidist.infer.sampling import GREEDY
from minidist.parallel.pipeline import partition_uniform
from minidist.parallel.sharding import Shard, split_columns, split_rows


def stage_weights(w: GPTWeights, pp_rank: int, pp: int) -> GPTWeights:
    """The blocks of one pipeline stage; the embedding on the first, the head on the last."""
    start, stop = partition_uniform(len(w.blocks), pp)[pp_rank]
    first, last = pp_rank == 0, pp_rank == pp - 1
    return GPTWeights(blocks=w.blocks[start:stop], block_size=w.block_size, vocab_size=w.vocab_size,
                      wte=w.wte if first else None, wpe=w.wpe if first else None,
                      ln_f=w.ln_f if last else None, head_w=w.head_w if last else None)


def tp_shard(w: GPTWeights, tp_rank: int, tp: int, reduce, rank=None) -> GPTWeights:
    """This rank's slices of every block: its heads' q/k/v columns and proj rows, its MLP units.

    The slicing rules are training's (``split_qkv``, ``split_columns``, ``split_rows`` of
    ``minidist.parallel.sharding``): a rank serves exactly the shard it would train.
    """
    blocks = []
    for blk in w.blocks:
        h, hidden = blk.n_head, blk.fc_w.shape[1]
        who = f"rank {rank}: " if rank is not None else ""
        if h % tp:
            raise ValueError(f"{who}n_head {h} is not divisible by tp {tp}: each rank needs whole heads "
                             f"(choose tp from the divisors of {h})")
        if hidden % tp:
            raise ValueError(f"{who}MLP hidden size {hidden} is not divisible by tp {tp}")
        blocks.append(replace(
            blk,
            qkv_w=Shard(1, blocks=3).split(blk.qkv_w, tp_rank, tp).copy(),
            qkv_b=Shard(0, blocks=3).split(blk.qkv_b, tp_rank, tp).copy(),
            proj_w=split_rows(blk.proj_w, tp_rank, tp).copy(),
            fc_w=split_columns(blk.fc_w, tp_rank, tp).copy(),
            fc_b=split_columns(blk.fc_b, tp_rank, tp).copy(),
            mlp_w=split_rows(blk.mlp_w, tp_rank, tp).copy(),
            n_head=h // tp, reduce=reduce))
    return replace(w, blocks=blocks)


def shard_for(mesh: Mesh, model) -> GPTWeights:
    """This rank's weights on ``mesh``: its pipeline stage, then its tensor-parallel slices."""
    w = stage_weights(as_weights(model), mesh.pp_rank, mesh.pp_size)
    if mesh.tp_size == 1:
        return w
    tp = mesh.tp
    return tp_shard(w, mesh.tp_rank, mesh.tp_size, lambda x: all_reduce(tp, x), rank=mesh.world.rank)


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
    w = shard_for(mesh, model)
    cache = KVCache.for_weights(w, len(prompts), max(len(p) for p in prompts) + max_new_tokens)
    last = mesh.pp_rank == pp - 1
    sampler = mesh.rank_of(pp - 1, 0, 0)

    def step(active, feed):
        x = None if mesh.pp_rank == 0 else mesh.pp.recv(mesh.pp_rank - 1)
        tracer = trace.current()
        if tracer is None:
            out = forward_tokens(w, cache, active, feed, x=x)
        else:
            with tracer.span("prefill" if max(map(len, feed)) > 1 else "decode", "compute"):
                out = forward_tokens(w, cache, active, feed, x=x)
        if not last:
            mesh.pp.send(out, mesh.pp_rank + 1)
            return None
        return host(last_logits(out, feed)) if mesh.tp_rank == 0 else None

    def agree(tokens):
        return comm.bcast_obj(tokens, root=sampler)

    return decode_loop(step, prompts, max_new_tokens, sampling, stop_tokens, return_logits, agree=agree,
                       vocab_size=cfg.vocab_size)
