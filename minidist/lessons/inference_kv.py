"""Lesson 9, part 1: the model every section serves, and the KV cache against recomputing the context.

``build_model`` trains a small byte-level GPT on rank 0 and hands every rank its weights;
``cache_vs_recompute`` generates the same tokens with and without the KV cache (tokens/s, and
``why_not_38x``: why the token-count ratio is not the speed-up on a small model).
"""

from __future__ import annotations

import textwrap
import time

import numpy as np

from minidist.accel.backend import to_host
from minidist.infer import (
    SamplingParams,
    generate,
    generate_recompute,
)
from minidist.lessons.train import train
from minidist.nn import GPT, GPTConfig
from minidist.nn.data import BatchLoader, ByteTokenizer, TextDataset
from minidist.trace.spans import now

TOK = ByteTokenizer()
BATCH = 16  # training windows per step


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
        losses = train(model, BatchLoader(data, BATCH, seed=args.seed), args.steps, 3e-3, log=False)
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
    t0 = now()
    fast, fast_logits = generate(model, [prompt], n, sp, return_logits=True)
    t_cache = now() - t0
    t0 = now()
    slow, slow_logits = generate_recompute(model, [prompt], n, sp, return_logits=True)
    t_full = now() - t0
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

def kv_width(args) -> int:
    """K/V numbers per token per layer: K heads of d/H each (d when K = H)."""
    return args.kv_heads * (args.d_model // args.heads)
