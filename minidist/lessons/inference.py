"""Lesson 9: serving a GPT -- KV cache, batching, paged cache, sharding, speculative, disaggregated.

    python -m minidist.lessons.inference --ranks 4
    mpirun -n 4 python -m minidist.lessons.inference

Rank 0 trains a small byte-level GPT for a few seconds and hands every rank the weights. Rank 0
then shows the KV cache against recompute, static against continuous batching, paged KV memory
with preemption, prefix caching, the cache's bytes per token (GQA, int8) and speculative decoding;
all ranks then generate with the model split by tensor and pipeline parallelism, and serve with
prefill and decode on separate ranks. Chapter 9 explains each number.

One idea to a file: ``inference_kv``, ``inference_batching``, ``inference_prefix``,
``inference_speculative``, ``inference_sharded``, ``inference_disaggregated``; this file runs them
in order.
"""

from __future__ import annotations

from minidist.infer import early_exit_draft
from minidist.lessons import inference_sharded as shard
from minidist.lessons import inference_speculative as spec
from minidist.lessons.cli import (
    finish,
    launch,
    lesson_parser,
    nonnegative_int,
    positive_int,
    rprint,
    world_size,
)
from minidist.lessons.inference_batching import batching, paging, plot
from minidist.lessons.inference_disaggregated import disaggregation
from minidist.lessons.inference_kv import BATCH, PROMPTS, build_model, cache_vs_recompute, enc
from minidist.lessons.inference_prefix import kv_memory, prefix_caching
from minidist.lessons.inference_sharded import mesh_for, sharded
from minidist.lessons.inference_speculative import speculative
from minidist.nn.data import default_text


def rank_main(comm, args):
    model = build_model(comm, args)
    ok = True
    if comm.rank == 0:
        ok &= cache_vs_recompute(model, args)
        good, reqs, res = batching(model, args)
        ok &= good
        ok &= paging(model, args, reqs, res["continuous"][0])
        ok &= prefix_caching(model, args)
        ok &= kv_memory(model, args, reqs, res["continuous"][0])
        if args.speculative:
            ok &= speculative(model, early_exit_draft(model, args.draft_layers), args, comm.clock)
        if args.plot:
            plot(args.plot, res, args.batch)
    with comm.patient("rank 0 runs sections 1-4"):
        comm.barrier()
    ok &= sharded(comm, model, args)
    ok &= disaggregation(comm, model, args)
    rprint(comm, f"\nall checks: {'PASS' if ok else 'FAIL'}")
    return finish(comm, ok)


def context_needed(args, n: int) -> tuple:
    """The least ``--block`` every section fits in, and which section sets it: each section's
    longest prompt plus the tokens it generates after it (``check_prompt``'s rule, checked here
    before any rank starts instead of inside one)."""
    longest = lambda prompts: max(len(enc(q)) for q in prompts)  # noqa: E731
    needs = [(longest(PROMPTS) + 16 + 1, "the batched workload's prompts with 16-token answers (+1 spare)")]
    if args.speculative:
        needs.append((longest(PROMPTS[:spec.PROMPT_COUNT]) + spec.NEW_TOKENS,
                      f"speculative decoding's prompts with {spec.NEW_TOKENS}-token answers "
                      "(or --speculative 0)"))
    if mesh_for(n, args) is not None:
        needs.append((longest(PROMPTS[:shard.PROMPT_COUNT]) + shard.NEW_TOKENS,
                      f"sharded generation's prompts with {shard.NEW_TOKENS}-token answers"))
    return max(needs)


def split_ranks(p, text: str, n: int):
    """``--disaggregate``'s (P, D): "auto" is half the ranks prefilling (None on one rank)."""
    if text == "auto":
        return (n // 2, n - n // 2) if n >= 2 else None
    parts = text.split(":")
    if len(parts) != 2 or not all(x.isdigit() and int(x) >= 1 for x in parts):
        p.error(f"argument --disaggregate: give P:D, prefill and decode ranks, each >= 1 "
                f"(e.g. 1:{max(n - 1, 1)}), got {text!r}")
    pd = (int(parts[0]), int(parts[1]))
    if sum(pd) != n:
        p.error(f"argument --disaggregate: {text} uses {sum(pd)} ranks, the run has {n}; P + D must equal it")
    return pd


def main(argv=None):
    p = lesson_parser(__doc__.splitlines()[0], ranks=2)
    p.add_argument("--steps", type=positive_int, default=250, help="training steps (rank 0)")
    p.add_argument("--block", type=positive_int, default=80, help="context length")
    p.add_argument("--layers", type=positive_int, default=2)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--d-model", type=positive_int, default=96, help="a multiple of --heads")
    p.add_argument("--batch", type=positive_int, default=4, help="slots for batched serving")
    p.add_argument("--kv-heads", type=positive_int, default=None, metavar="K",
                   help="key/value heads (grouped-query attention; a divisor of --heads; default --heads)")
    p.add_argument("--kv-dtype", choices=("float32", "int8"), default="float32",
                   help="int8: also serve over an int8 KV cache (bytes, tokens and logit error vs float32)")
    p.add_argument("--speculative", type=nonnegative_int, default=4, metavar="K",
                   help="tokens the draft proposes per round (0: skip speculative decoding)")
    p.add_argument("--draft-layers", type=positive_int, default=1,
                   help="the draft's layers: the target's first ones, with its embedding and head")
    p.add_argument("--disaggregate", default="auto", metavar="P:D",
                   help="prefill:decode ranks, P + D = the ranks (default: half and half)")
    args = p.parse_args(argv)
    if args.draft_layers > args.layers:
        p.error(f"argument --draft-layers: the draft must not be bigger than the target's --layers "
                f"{args.layers}, got {args.draft_layers}")
    args.disaggregate = split_ranks(p, args.disaggregate, world_size(args))
    if args.d_model % args.heads:
        p.error(f"argument --d-model: must be a multiple of --heads {args.heads}, got {args.d_model}")
    args.kv_heads = args.heads if args.kv_heads is None else args.kv_heads
    if args.heads % args.kv_heads:
        p.error(f"argument --kv-heads: must divide --heads {args.heads} (each K/V head serves a whole group "
                f"of query heads), got {args.kv_heads}")
    need, why = context_needed(args, world_size(args))
    if args.block < need:
        p.error(f"argument --block: {why} need a context of >= {need} tokens, got {args.block}; "
                f"use --block {need} or more")
    text = len(enc(default_text()))  # the model trains on BATCH windows of the text, each block + 1 tokens
    windows = lambda b: -(-(text - b) // max(1, b // 2))  # noqa: E731 - TextDataset's count (stride b // 2)
    if windows(args.block) < BATCH:
        most = max(b for b in range(1, text) if windows(b) >= BATCH)
        p.error(f"argument --block: training takes batches of {BATCH} windows of block + 1 tokens from a "
                f"text of {text} tokens, so the context can be at most {most}; got {args.block}")
    return launch(rank_main, args)


if __name__ == "__main__":
    from minidist.lessons.cli import run_lesson

    run_lesson(main)
