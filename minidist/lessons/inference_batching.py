"""Lesson 9, part 2: static vs continuous batching of a mixed-length workload, and the paged KV cache.

The same requests served with every slot waiting for the longest answer (static) and with a
finished slot refilled at once (continuous): the same tokens, fewer steps; a slot timeline in text
and in ``--plot``. Then paged against contiguous KV memory, and preemption with recompute when the
block pool is too small.
"""

from __future__ import annotations

import math

import numpy as np

from minidist.infer import (
    GREEDY,
    Decoder,
    KVCache,
    Request,
    serve,
)
from minidist.lessons.inference_kv import PROMPTS, enc


def workload(args, n=12):
    rng = np.random.default_rng(args.seed)
    out = []
    for i in range(n):
        prompt = enc(PROMPTS[i % len(PROMPTS)])
        new = int(rng.choice([4, 8, 12, 16])) if rng.random() < 0.75 else args.block - len(prompt)
        out.append(Request(i, prompt, new, GREEDY, arrival=int(rng.integers(0, 6))))
    return out


def slot_timeline(history, slots, width=72) -> list:
    """One text row per slot: the letter of the request it runs at each step ('.' = idle)."""
    rows = []
    steps = history[:width]
    for s in range(slots):
        cells = "".join(chr(ord("a") + h[s] % 26) if s in h else "." for h in steps)
        rows.append(f"   slot {s} |{cells}|" + ("..." if len(history) > width else ""))
    return rows


def batching(model, args):
    reqs = workload(args)
    print(f"\n2. batching {len(reqs)} requests (answers {min(r.max_new_tokens for r in reqs)}-"
          f"{max(r.max_new_tokens for r in reqs)} tokens, arriving over 6 steps), {args.batch} slots")
    # Timed on rank 0 alone (the other ranks wait at a barrier, asleep), best of 3 runs taken in
    # turn: a busy machine's noise then hits both policies alike instead of deciding the comparison.
    res, best = {}, {}
    for _ in range(3):
        for policy in ("static", "continuous"):
            res[policy] = serve(model, reqs, max_batch=args.batch, policy=policy)
            best[policy] = min(best.get(policy, math.inf), res[policy][1]["seconds"])
    for policy in ("static", "continuous"):
        _, stats, done = res[policy]
        lat = np.mean([r.finished - r.arrival + 1 for r in done])
        per_step = stats["tokens"] / stats["steps"]
        print(f"   {policy:10s}: {stats['steps']:4d} steps, {per_step:.2f} tokens/step, "
              f"{stats['tokens'] / best[policy]:6.0f} tokens/s, mean latency {lat:5.1f} steps")
        for row in slot_timeline(stats["history"], args.batch):
            print(row)
    print(f"   continuous / static: {res['static'][1]['steps'] / res['continuous'][1]['steps']:.2f}x fewer "
          f"steps, {best['static'] / best['continuous']:.2f}x the tokens/s (best of 3 each)")
    ok = res["static"][0] == res["continuous"][0]
    print(f"   serial twin: continuous == static token for token: {'PASS' if ok else 'FAIL'}")
    return ok, reqs, res


def paging(model, args, reqs, contiguous_out):
    bl = 16
    cache = KVCache.for_decoder(Decoder.from_model(model), args.batch)
    per_tok = cache.bytes_per_token()
    print(f"\n3. paged KV cache: blocks of {bl} tokens; {per_tok:,} bytes per token (2·L·K·(d/H)·4)")
    out_c, st_c, _ = serve(model, reqs, max_batch=args.batch)
    out_p, st_p, _ = serve(model, reqs, max_batch=args.batch, cache="paged", block_len=bl)
    need = max(math.ceil((len(r.prompt) + r.max_new_tokens) / bl) for r in reqs)
    out_t, st_t, _ = serve(model, reqs, max_batch=args.batch, cache="paged", block_len=bl,
                           num_blocks=need + 1)
    print(f"   contiguous: reserves slots·max_len·bytes = {args.batch}·{args.block}·{per_tok} = "
          f"{st_c['peak_reserved']:,} bytes; at most {st_c['peak_used']:,} hold tokens "
          f"({100 * st_c['peak_used'] / st_c['peak_reserved']:.0f}%)")
    print(f"   paged:      peak {st_p['peak_reserved']:,} bytes in blocks for {st_p['peak_used']:,} of "
          f"tokens (waste < one block per sequence: {args.batch}·{bl}·{per_tok} = "
          f"{args.batch * bl * per_tok:,})")
    print(f"   a pool of only {need + 1} blocks: {st_t['preemptions']} preemptions (recomputed later), "
          f"{st_t['steps']} steps instead of {st_p['steps']}")
    ok = out_p == out_c == out_t == contiguous_out
    print(f"   serial twin: paged == contiguous, with and without preemption: {'PASS' if ok else 'FAIL'}")
    return ok


def plot(path, res, slots):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    longest = max(len(res[p][1]["history"]) for p in res)
    for k, policy in enumerate(("static", "continuous")):
        ax = fig.add_subplot(2, 1, k + 1)
        hist = res[policy][1]["history"]
        grid = np.full((slots, len(hist)), np.nan)
        for t, h in enumerate(hist):
            for s, rid in h.items():
                grid[s, t] = rid % 20
        ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="tab20", vmin=0, vmax=19)
        ax.set_xlim(-0.5, longest - 0.5)
        ax.set_ylabel("batch slot")
        ax.set_title(f"{policy} batching: {len(hist)} decode steps for the same requests "
                     "(colour = request, white = idle slot)", fontsize=10)
    ax.set_xlabel("decode step (one forward pass of the whole batch)")
    fig.tight_layout()
    FigureCanvasAgg(fig).print_png(path)
    print(f"wrote {path}")
