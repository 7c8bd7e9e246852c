"""Lesson 9, part 4: speculative decoding with a draft made of the target's first layers.

The same tokens as greedy decoding of the target, its acceptance rate and speed-up beside the
formula (``minidist.infer.expected_speedup``).
"""

from __future__ import annotations

import math
import time

from minidist.infer import (
    SamplingParams,
    SpecStats,
    expected_speedup,
    generate,
    speculative_generate,
)
from minidist.lessons.inference_kv import PROMPTS, enc

NEW_TOKENS = 32  # each prompt's answer: ``main`` checks --block holds the longest prompt plus these
PROMPT_COUNT = 3  # the first PROMPTS


def speculative(model, draft, args):
    """Greedy: the same tokens as the target alone, in fewer target passes; a, c and the formula."""
    k, n = args.speculative, NEW_TOKENS
    prompts = [enc(p) for p in PROMPTS[:PROMPT_COUNT]]
    runs = {"target": lambda: generate(model, prompts, n), "draft": lambda: generate(draft, prompts, n),
            "speculative": lambda: speculative_generate(model, draft, prompts, n, k=k, stats=st)}
    best, outs = {name: math.inf for name in runs}, {}
    for _ in range(3):  # best of 3, taken in turn: a busy machine's noise hits all three alike
        for name, fn in runs.items():
            st = SpecStats()
            t0 = time.perf_counter()
            outs[name] = fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    sampled = SpecStats()
    sp = SamplingParams(0.8, top_k=40, seed=args.seed)
    speculative_generate(model, draft, prompts, n, k=k, sampling=sp, stats=sampled)
    a, c = st.acceptance_rate, best["draft"] / best["target"]
    print(f"\n4. speculative decoding: a {args.draft_layers}-layer early-exit draft proposes k={k} tokens, "
          f"the {args.layers}-layer target checks them in one pass ({len(prompts)} prompts x {n} tokens, "
          "greedy)")
    print(f"   acceptance rate a = {a:.2f} ({sampled.acceptance_rate:.2f} sampling at temperature 0.8, "
          f"top-k 40); tokens per round {st.tokens_per_round:.2f}, (1 - a^(k+1)) / (1 - a) = "
          f"{expected_speedup(a, k, 0.0):.2f}")
    print(f"   target passes {st.target_passes} instead of {n} (prefill + one per token); a draft step costs "
          f"c = {c:.2f} target steps (plain decoding of each, best of 3)")
    print(f"   speed-up over the target alone: measured {best['target'] / best['speculative']:.2f}x, "
          f"formula (1 - a^(k+1)) / ((1 - a)(k·c + 1)) = {expected_speedup(a, k, c):.2f}x")
    ok = outs["speculative"] == outs["target"]
    print(f"   serial twin: the same tokens as the target alone: {'PASS' if ok else 'FAIL'}")
    return ok
