"""Lesson 9: serving a GPT -- KV cache, batching, paged cache, sharding, speculative, disaggregated.

    python -m minidist.lessons.inference --ranks 4
    mpirun -n 4 python -m minidist.lessons.inference

Rank 0 trains a small byte-level GPT on minidist's own text for a few seconds and hands the
weights to every rank. Then, on rank 0: tokens/s with and without the KV cache (same tokens);
static vs continuous batching of a mixed-length workload (same tokens, fewer steps, lower
latency) with a slot timeline; paged vs contiguous KV memory, and preemption with recompute
when the block pool is too small; prefix caching of a shared system prompt (hit rate, prefill
tokens saved, time to first token with and without); the KV cache's bytes per token beside the
formula, grouped-query attention (``--kv-heads``) and int8 (``--kv-dtype int8``) shrinking it;
speculative decoding with a smaller draft model, the target's first layers (its acceptance rate
and speed-up beside the formula). Then all ranks generate
together, the model split by tensor parallelism (heads and MLP) and pipeline stages, checked
against one process; and serve a mixed workload with prefill and decode on separate ranks, beside
every rank doing both.
"""

from __future__ import annotations

import math
import textwrap
import time

import numpy as np

from minidist.accel.backend import to_host
from minidist.comm import measure
from minidist.comm.cost import all_reduce_bytes_sent
from minidist.infer import (
    GREEDY,
    Decoder,
    Int8KVCache,
    KVCache,
    Request,
    SamplingParams,
    SpecStats,
    early_exit_draft,
    expected_speedup,
    forward_tokens,
    generate,
    generate_recompute,
    int8_bytes_per_token,
    serve,
    sharded_generate,
    speculative_generate,
)
from minidist.infer.disaggregated import colocated_serve, disaggregated_serve, kv_message_bytes
from minidist.lessons.cli import (
    finish,
    launch,
    lesson_parser,
    nonnegative_int,
    positive_int,
    rprint,
    world_size,
)
from minidist.lessons.train import train
from minidist.nn import GPT, GPTConfig
from minidist.nn.data import BatchLoader, ByteTokenizer, TextDataset
from minidist.parallel.pipeline.runtime import partition_uniform

TOK = ByteTokenizer()
PROMPTS = ["Data parallelism ", "The pipeline ", "A neural network ", "Each rank ", "The gradient ",
           "Tensor parallel", "Memory ", "We ", "The model ", "A ring all-reduce "]


def enc(text) -> list:
    return [int(t) for t in TOK.encode(text)]


def build_model(comm, args) -> GPT:
    """Rank 0 trains for a few seconds; every rank receives the same weights."""
    cfg = GPTConfig(vocab_size=TOK.vocab_size, block_size=args.block, n_layer=args.layers, n_head=args.heads,
                    d_model=args.d_model, seed=args.seed, n_kv_head=getattr(args, "kv_heads", None))
    model = GPT(cfg)
    state = None
    if comm.rank == 0:
        data = TextDataset.from_file(None, block_size=args.block)
        t0 = time.perf_counter()
        losses = train(model, BatchLoader(data, 16, seed=args.seed), args.steps, 3e-3, log=False)
        print(f"trained a {cfg.n_layer}-layer GPT (d_model {cfg.d_model}, {cfg.n_head} heads, "
              f"{cfg.kv_heads} K/V heads, context "
              f"{cfg.block_size}, {model.num_parameters():,} parameters) for {args.steps} steps in "
              f"{time.perf_counter() - t0:.1f}s: loss {np.mean(losses[:5]):.2f} -> "
              f"{np.mean(losses[-5:]):.2f}", flush=True)
        state = {k: to_host(v) for k, v in model.state_dict().items()}
    with comm.patient("rank 0 trains the model"):  # the others wait for it: no "still waiting" noise
        model.load_state_dict(comm.bcast_obj(state, root=0))
    model.eval()
    return model


def cache_vs_recompute(model, args):
    prompt = enc(PROMPTS[0])
    n = args.block - len(prompt)
    sp = SamplingParams(temperature=0.8, top_k=40, seed=args.seed)
    generate(model, [prompt], 4)
    t0 = time.perf_counter()
    fast, fast_logits = generate(model, [prompt], n, sp, return_logits=True)
    t_cache = time.perf_counter() - t0
    t0 = time.perf_counter()
    slow, slow_logits = generate_recompute(model, [prompt], n, sp, return_logits=True)
    t_full = time.perf_counter() - t0
    diff = float(np.abs(fast_logits[0] - slow_logits[0]).max())
    p = len(prompt)
    print(f"\n1. KV cache: prompt {p} tokens + {n} new (temperature 0.8, top-k 40)")
    print(f"   > {TOK.decode(prompt + fast[0])!r}")
    print(f"   with cache {n / t_cache:7.0f} tokens/s   tokens through the model: p + n = {p + n}")
    print(f"   recompute  {n / t_full:7.0f} tokens/s   tokens through the model: sum_t (p + t) = "
          f"{sum(p + t for t in range(n))}")
    print(f"   speed-up {t_full / t_cache:.1f}x; cache memory 2·L·T·K·(d/H)·4 bytes = "
          f"{2 * args.layers * (p + n) * kv_width(args) * 4:,} bytes")
    print(textwrap.fill(why_not_38x(p, n, t_cache, t_full), 104, initial_indent="   ",
                        subsequent_indent="   "))
    ok = fast == slow and diff < 1e-4
    print(f"   serial twin: same tokens {fast == slow}, max |logits diff| {diff:.1e}  "
          f"{'PASS' if ok else 'FAIL'}")
    return ok


def why_not_38x(p: int, n: int, t_cache: float, t_full: float) -> str:
    """Why {sum_t (p+t)}/(p+n) times more tokens cost only a few times more: both runs take n forward
    passes, and a pass costs a fixed F (Python, op dispatch, the weights read once) plus c per token.
    Solve t_cache = n·F + (p+n)·c and t_full = n·F + S·c for F and c (S = sum_t (p+t))."""
    cached, full = p + n, sum(p + t for t in range(n))
    c = max((t_full - t_cache) / (full - cached), 0.0)
    fixed = max((t_cache - cached * c) / n, 0.0)
    return (f"{full / cached:.0f}x the tokens, {t_full / t_cache:.1f}x the time: both runs make {n} forward "
            f"passes, and a pass costs a fixed {fixed * 1e3:.2f} ms (Python, op dispatch, reading the "
            f"weights) plus {c * 1e6:.0f} us per token (fitted from the two runs), so the cached run is "
            f"{n * fixed / t_cache:.0%} fixed cost; the cache wins by the token count only when a token "
            f"costs more than a pass's overhead -- long contexts, big models")


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


SYSTEM = "You are minidist's tutor: answer briefly. "


def kv_width(args) -> int:
    """K/V numbers per token per layer: K heads of d/H each (d when K = H)."""
    return args.kv_heads * (args.d_model // args.heads)


def prefix_caching(model, args):
    """A shared system prompt, a request arriving every 2 steps: later requests find its blocks."""
    bl, new = 8, 8
    head = enc(SYSTEM)[:max(0, args.block - max(len(enc(q)) for q in PROMPTS) - new)]
    reqs = [Request(i, head + enc(PROMPTS[i % len(PROMPTS)]), new, GREEDY, arrival=2 * i) for i in range(12)]
    res, ttft = {}, {}
    for _ in range(3):  # best of 3 medians, taken in turn
        for name, kw in (("without", {"cache": "paged"}), ("with", {"prefix_cache": True})):
            res[name] = serve(model, reqs, max_batch=args.batch, block_len=bl, **kw)
            med = float(np.median([r.ttft_s for r in res[name][2]]))
            ttft[name] = min(ttft.get(name, math.inf), med)
    st = res["with"][1]
    print(f"\n3b. prefix caching: {len(reqs)} requests share a {len(head)}-token system prompt "
          f"(one arrives every 2 steps, blocks of {bl}, {args.batch} slots)")
    print(f"   hit rate {st['hit_rate']:.0%} of {st['looked_up_tokens']} prompt tokens; prefill tokens saved "
          f"{st['prefill_tokens_saved']} (>= (n-1)·{len(head) // bl}·{bl}: the system prompt's whole "
          f"blocks; a repeated question shares more)")
    print(f"   tokens through the model: {res['without'][1]['forward_rows']} without, "
          f"{st['forward_rows']} with")
    print(f"   time to first token (median, best of 3): {1e3 * ttft['without']:.2f} ms without, "
          f"{1e3 * ttft['with']:.2f} ms with")
    saved = st["prefill_tokens_saved"] >= (len(reqs) - 1) * (len(head) // bl) * bl
    ok = res["with"][0] == res["without"][0] and saved
    print(f"   serial twin: the same tokens with and without sharing, saved >= formula {saved}: "
          f"{'PASS' if ok else 'FAIL'}")
    return ok


def kv_memory(model, args, reqs, contiguous_out):
    """Bytes per cached token from the arrays beside the formulas; int8: tokens and logit error."""
    dec, L, H, K = Decoder.from_model(model), args.layers, args.heads, args.kv_heads
    hd = args.d_model // H
    measured = KVCache.for_decoder(dec, 1).bytes_per_token()
    mha = KVCache(L, 1, H, hd, 1).bytes_per_token()
    print(f"\n3c. KV cache bytes per token: {H} query heads, K = {K} K/V heads (--kv-heads), head_dim {hd}")
    print(f"   multi-head 2·L·H·(d/H)·4 = {2 * L * H * hd * 4:,} (measured {mha:,}); this model "
          f"2·L·K·(d/H)·4 = {2 * L * K * hd * 4:,} (measured {measured:,}): H/K = {H // K}x smaller")
    ok = measured == 2 * L * K * hd * 4 and mha == 2 * L * H * hd * 4
    if args.kv_dtype == "int8":
        q = Int8KVCache.for_decoder(dec, args.batch)
        want = int8_bytes_per_token(L, K, hd)
        out, _, _ = serve(model, reqs, max_batch=args.batch, cache=q)
        same = sum(out[i] == contiguous_out[i] for i in out)
        seq = enc(PROMPTS[0]) + contiguous_out[0]
        a, b = (to_host(forward_tokens(dec, c, [0], [seq]))[0]
                for c in (KVCache.for_decoder(dec, 1), Int8KVCache.for_decoder(dec, 1)))
        err, bound = float(np.abs(a - b).max()), 0.01 * float(np.abs(a).max())
        print(f"   int8 (--kv-dtype int8): 2·L·K·(d/H + 4) = {want:,} bytes (measured "
              f"{q.bytes_per_token():,}): {measured / want:.2f}x smaller than float32")
        print(f"   greedy tokens: {same} of {len(out)} requests identical to the float32 cache"
              + ("" if same == len(out) else " (int8 rounding changed a close argmax: reported, not hidden)"))
        print(f"   max |logits diff| over a {len(seq)}-token sequence {err:.1e} (bound 1% of max |logit| = "
              f"{bound:.1e})")
        ok &= q.bytes_per_token() == want and err <= bound
    print(f"   measured == formula: {'PASS' if ok else 'FAIL'}")
    return ok


def speculative(model, draft, args):
    """Greedy: the same tokens as the target alone, in fewer target passes; a, c and the formula."""
    k, n = args.speculative, 32
    prompts = [enc(p) for p in PROMPTS[:3]]
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


def mixed_workload(args, n=16):
    """Every 4th request a long prompt (most of the context), the rest short; 12 tokens each,
    arriving 2 ms apart."""
    long_text = enc(" ".join(PROMPTS))[:args.block - 13]
    reqs = [Request(i, long_text if i % 4 == 0 else enc(PROMPTS[i % len(PROMPTS)]), 12) for i in range(n)]
    return reqs, [0.002 * i for i in range(n)]


def disaggregation(comm, model, args):
    if args.disaggregate is None:
        rprint(comm, "\n6. disaggregated serving: needs >= 2 ranks (--disaggregate P:D)")
        return True
    p, d = args.disaggregate
    reqs, arrivals = mixed_workload(args)
    colo = colocated_serve(comm, model, reqs, arrivals, max_batch=args.batch)
    with measure(comm) as m:
        dis = disaggregated_serve(comm, model, reqs, arrivals, prefill_ranks=p, max_batch=args.batch)
    sent = comm.gather_obj(m.bytes_sent, root=0)
    if comm.rank != 0:
        return True
    lens = sorted({len(r.prompt) for r in reqs})
    print(f"\n6. disaggregated serving: {len(reqs)} requests (prompts of {lens[0]}-{lens[-1]} tokens, every "
          f"4th long; 12 new tokens each, arriving 2 ms apart), {comm.size} ranks")
    print(f"   {'':28s}{'TTFT p50':>10s}{'p90':>9s}{'TPOT p50':>10s}{'p90':>9s}   (ms)")
    for name, sv in ((f"colocated ({comm.size} x both)", colo), (f"disaggregated ({p} : {d})", dis)):
        ms = {key: 1e3 * v for key, v in sv.summary().items()}
        print(f"   {name:28s}{ms['ttft_p50']:10.1f}{ms['ttft_p90']:9.1f}{ms['tpot_p50']:10.2f}"
              f"{ms['tpot_p90']:9.2f}")
    want = [sum(kv_message_bytes(model.config, len(r.prompt)) * args.kv_heads // args.heads
                for i, r in enumerate(reqs) if i % p == rank) if rank < p else 0 for rank in range(comm.size)]
    print(f"   KV caches sent per rank: {', '.join(f'{b:,}' for b in sent)}")
    print(f"   formula sum 2·L·T·K·(d/H)·4 over each prefill rank's prompts: "
          f"{', '.join(f'{b:,}' for b in want)}")
    ok = dis.outputs == colo.outputs and sent == want
    print(f"   serial twin: disaggregated == colocated token for token, bytes == formula: "
          f"{'PASS' if ok else 'FAIL'}")
    return ok


def mesh_for(n, args):
    tp = math.gcd(n, args.heads)
    pp = n // tp
    return (tp, pp) if pp <= args.layers else None


def all_reduce_bytes(name: str, nbytes: int, p: int, r: int) -> int | None:
    """Bytes rank r of p sends in one all-reduce the ledger calls ``name``: minidist.comm.cost's
    formula (exact here: tp divides d_model). None for an algorithm without one."""
    algorithm = name.removesuffix("_all_reduce")
    if algorithm not in ("ring", "two_shot", "halving_doubling", "recursive_doubling"):
        return None
    return all_reduce_bytes_sent(algorithm, nbytes, p, r)


def sharded(comm, model, args):
    shape = mesh_for(comm.size, args)
    rprint(comm, f"\n5. sharded generation on {comm.size} ranks")
    if shape is None:
        rprint(comm, f"   (can't split {args.heads} heads x {args.layers} layers over {comm.size} ranks as "
               "tp x pp; try 1, 2, 4 or 8 ranks)")
        return True
    tp, pp = shape
    prompts = [enc(p) for p in PROMPTS[:3]]
    n = 24
    with measure(comm) as m:
        t0 = time.perf_counter()
        toks, logits = sharded_generate(comm, model, prompts, n, GREEDY, tp=tp, pp=pp, return_logits=True)
        dt = time.perf_counter() - t0
    calls = [c.name for c in m.calls if "all_reduce" in c.name]
    sampler = (pp - 1) * tp
    rows = comm.gather_obj((calls, m.bytes_sent, logits if comm.rank == sampler else None), root=0)
    if comm.rank != 0:
        return True
    ref, ref_logits = generate(model, prompts, n, GREEDY, return_logits=True)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(rows[sampler][2], ref_logits))
    bounds = partition_uniform(args.layers, pp)  # rank r is on stage r // tp, tp rank r % tp
    layers_here = bounds[0][1] - bounds[0][0]
    print(f"   mesh tp={tp} x pp={pp}: each rank holds {args.heads // tp} of {args.heads} heads and "
          f"{layers_here} of {args.layers} layers; {3 * n / dt:.0f} tokens/s")
    if tp > 1:
        print(f"   all-reduces per rank: measured {len(rows[0][0])}, formula 2·layers·steps = "
              f"2·{layers_here}·{n} = {2 * layers_here * n}")
    # one step's activations: B·T·d·4 bytes, T = the longest prompt for the prefill, then 1 per decode
    # (no stop tokens: every sequence runs all n steps); each layer all-reduces them twice
    step_bytes = [len(prompts) * t * args.d_model * 4 for t in [max(map(len, prompts))] + [1] * (n - 1)]
    expect = []
    for r, (names, _, _) in enumerate(rows):
        start, stop = bounds[r // tp]
        sizes = [b for b in step_bytes for _ in range(2 * (stop - start))] if tp > 1 else []
        per_call = [all_reduce_bytes(a, b, tp, r % tp) for a, b in zip(names, sizes)]
        onward = sum(step_bytes) if r // tp < pp - 1 else 0  # hidden states to the next stage
        ok_count = len(names) == len(sizes) and None not in per_call
        expect.append(sum(per_call) + onward if ok_count else None)
    used = sorted({a.replace("_all_reduce", "") for names, _, _ in rows for a in names})
    if used:
        fold = " (+N for the odd ranks < 2·rem that fold in: p is not a power of 2)" \
            if tp & (tp - 1) and {"recursive_doubling", "halving_doubling"} & set(used) else ""
        print(f"   each all-reduce of N = B·T·d·4 bytes ran {', '.join(used)} (the tensor-parallel group's "
              f"algorithm, parallel/tensor/comm.py):\n   ring and two-shot send 2(p-1)/p·N, "
              f"recursive doubling log2(p)·N, "
              f"halving-doubling 2(p-1)/p·N{fold}")
    print(f"   bytes sent per rank: {', '.join(f'{r[1]:,}' for r in rows)}")
    print(f"   formula{' (+ ΣB·T·d·4 sent on to the next stage)' if pp > 1 else ''}: "
          f"{', '.join('?' if e is None else f'{e:,}' for e in expect)}")
    for p, t in zip(prompts, toks):
        print(f"   > {TOK.decode(p + t)!r}")
    same_bytes = [r[1] for r in rows] == expect
    ok = toks == ref and diff < 1e-4 and same_bytes
    print(f"   serial twin: same tokens as one process {toks == ref}, max |logits diff| {diff:.1e}, "
          f"bytes == formula {same_bytes}  {'PASS' if ok else 'FAIL'}")
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
        ax.set_ylabel("slot")
        ax.set_title(f"{policy} batching: {len(hist)} steps (colour = request)")
    ax.set_xlabel("decode step")
    fig.tight_layout()
    FigureCanvasAgg(fig).print_png(path)
    print(f"wrote {path}")


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
            ok &= speculative(model, early_exit_draft(model, args.draft_layers), args)
        if args.plot:
            plot(args.plot, res, args.batch)
    with comm.patient("rank 0 runs sections 1-4"):
        comm.barrier()
    ok &= sharded(comm, model, args)
    ok &= disaggregation(comm, model, args)
    rprint(comm, f"\nall checks: {'PASS' if ok else 'FAIL'}")
    return finish(comm, ok)


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
    need = max(len(enc(q)) for q in PROMPTS) + 16 + 1  # the longest prompt, a 16-token answer, one more
    if args.block < need:
        p.error(f"argument --block: the lesson's prompts and answers need a context of >= {need} tokens, "
                f"got {args.block}")
    return launch(rank_main, args)


if __name__ == "__main__":
    from minidist.lessons.cli import run_lesson

    run_lesson(main)
