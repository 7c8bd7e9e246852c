"""Decode speed: minidist's KV cache vs full recompute vs PyTorch CPU eager with its own KV cache.

    python benchmarks/decode.py                 # batch 1, prompt 16, 256 new tokens, one thread
    python benchmarks/decode.py --new 64 --repeat 1

The model is the core benchmark's GPT (vocab 256, 4 layers, d_model 256, 4 heads), with the
context raised to fit prompt + new tokens. The PyTorch twin is ``benchmarks/torch_gpt.py``, loaded
with the same weights; it keeps its own preallocated KV cache. Targets: cached >= 7x recompute;
time per token <= 1.5x PyTorch's.
Then continuous vs static batching throughput on a workload of mixed lengths.
Needs torch for the PyTorch column (skipped, with a note, if it isn't installed).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from bench_env import Targets, clock_flags, print_machine, use_clock  # noqa: E402

from minidist.infer import Request, generate, generate_recompute, serve  # noqa: E402
from minidist.nn import GPT, GPTConfig  # noqa: E402


def interleaved(contenders: dict, repeat: int):
    """Median seconds of each contender, run in turns (a busy machine slows them all alike)."""
    for fn in contenders.values():  # warm up
        fn()
    times, outs = {k: [] for k in contenders}, {}
    for _ in range(repeat):
        for name, fn in contenders.items():
            t0 = time.perf_counter()
            outs[name] = fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}, outs


def workload(n, vocab, block, seed=0):
    """Mixed lengths: prompts 4-32 tokens; most answers short, a few long (a long tail)."""
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(n):
        new = int(rng.choice([8, 16, 24, 32, 160])) if rng.random() < 0.85 else 200
        plen = int(rng.integers(4, 33))
        reqs.append(Request(i, list(rng.integers(0, vocab, plen)), min(new, block - plen)))
    return reqs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--strict", action="store_true", help="exit 1 when a speed target is missed")
    clock_flags(ap)
    args = ap.parse_args(argv)
    use_clock(args, wall_only="its reference is PyTorch's KV-cached decoder, which only the wall clock "
                              "can time (minidist's decode on the virtual clock: python -m "
                              "minidist.lessons.inference --clock virtual --device h100)")
    for flag in ("prompt", "new", "repeat", "requests", "batch"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(1)
    except ImportError:
        pass

    print_machine()
    # the context fits the decode run and the serving workload's longest request (32 + 200 tokens)
    cfg = GPTConfig(vocab_size=256, n_layer=4, n_head=4, d_model=256,
                    block_size=max(args.prompt + args.new, 232))
    model = GPT(cfg)
    prompt = list(np.random.default_rng(0).integers(0, 256, args.prompt))
    n = args.new
    print(f"GPT {cfg.n_layer} layers, d_model {cfg.d_model}, {cfg.n_head} heads, vocab {cfg.vocab_size}; "
          f"batch 1, prompt {args.prompt}, {n} new tokens, greedy, one thread; median of {args.repeat}")

    contenders = {"minidist, KV cache": lambda: generate(model, [prompt], n)[0],
                  "minidist, full recompute": lambda: generate_recompute(model, [prompt], n)[0]}
    try:
        import torch
    except ImportError:
        torch_gen = None
        print("(torch not installed: pip install torch to add the PyTorch column)")
    else:
        from torch_gpt import from_minidist

        from minidist.infer import full_logits

        torch.set_num_threads(1)
        tmodel = from_minidist(model.state_dict(), cfg)
        torch_gen = tmodel.generate
        probe = prompt + generate(model, [prompt], 8)[0]
        with torch.inference_mode():
            theirs = tmodel(torch.tensor([probe]))[0].numpy()
        diff = np.abs(theirs - full_logits(model, probe)).max()
        print(f"same weights in PyTorch: max |logits diff| {diff:.2e}")
        contenders["PyTorch eager, KV cache"] = lambda: torch_gen(prompt, n)
        contenders["PyTorch eager, full recompute"] = lambda: torch_gen(prompt, n, use_cache=False)
    times, outs = interleaved(contenders, args.repeat)
    ours, ours_full = outs["minidist, KV cache"], outs["minidist, full recompute"]
    rows = list(times.items())
    t_cache, t_full = times["minidist, KV cache"], times["minidist, full recompute"]
    if torch_gen is not None:
        t_tc = times["PyTorch eager, KV cache"]
        agree = sum(a == b for a, b in zip(ours, outs["PyTorch eager, KV cache"]))
        print(f"greedy tokens agree with PyTorch: {agree}/{n}")
    print(f"tokens agree cache vs recompute: {sum(a == b for a, b in zip(ours, ours_full))}/{n}")
    print(f"\n{'':32s}{'tokens/s':>10s}{'ms/token':>10s}")
    for name, t in rows:
        print(f"{name:32s}{n / t:10.0f}{1000 * t / n:10.3f}")
    targets = Targets()
    targets.check("KV cache speed-up over recompute", t_full / t_cache, ">=", 7.0, "x")
    if torch_gen is not None:
        targets.check("minidist time per token / PyTorch's", t_cache / t_tc, "<=", 1.5, "x")

    reqs = workload(args.requests, cfg.vocab_size, cfg.block_size)
    total = sum(r.max_new_tokens for r in reqs)
    print(f"\nserving {len(reqs)} requests (prompts 4-32, answers {min(r.max_new_tokens for r in reqs)}-"
          f"{max(r.max_new_tokens for r in reqs)} tokens, {total} in all), max batch {args.batch}:")
    print(f"{'':22s}{'tokens/s':>10s}{'steps':>8s}{'mean latency (steps)':>22s}")
    runs = {"static": [], "continuous": []}
    for _ in range(args.repeat):  # in turns, medians: the machine may be busy
        for policy in runs:
            runs[policy].append(serve(model, reqs, max_batch=args.batch, policy=policy))
    outs, tps_of = {}, {}
    for policy, rs in runs.items():
        out, stats, done = rs[0]
        outs[policy] = out
        lat = np.mean([r.finished - r.arrival + 1 for r in done])
        tps_of[policy] = statistics.median(st["tokens"] / st["seconds"] for _, st, _ in rs)
        print(f"{policy + ' batching':22s}{tps_of[policy]:10.0f}{stats['steps']:8d}{lat:22.1f}")
    print(f"continuous / static throughput: {tps_of['continuous'] / tps_of['static']:.2f}x")
    print(f"same tokens: {outs['static'] == outs['continuous']}")
    if ours != ours_full or outs["static"] != outs["continuous"]:  # correctness, not speed: exit 1
        print("FAIL: the KV cache or continuous batching changed the tokens", file=sys.stderr)
        return 1
    return targets.exit_code(args.strict)


if __name__ == "__main__":
    sys.exit(main())
