"""Lesson 9, part 5: every rank generating together, the model split by tensor parallelism (heads
and MLP) and pipeline stages, checked token for token against one process, with its bytes.
"""

from __future__ import annotations

import math

import numpy as np

from minidist.comm import measure
from minidist.comm.cost import all_reduce_bytes_sent
from minidist.infer import (
    GREEDY,
    generate,
    sharded_generate,
)
from minidist.lessons.cli import (
    rprint,
)
from minidist.lessons.inference_kv import PROMPTS, TOK, enc
from minidist.parallel.pipeline.partition import partition_uniform
from minidist.trace.spans import now


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

NEW_TOKENS = 24  # each prompt's answer: ``main`` checks --block holds the longest prompt plus these
PROMPT_COUNT = 3  # the first PROMPTS


def sharded(comm, model, args):
    shape = mesh_for(comm.size, args)
    rprint(comm, f"\n5. sharded generation on {comm.size} ranks")
    if shape is None:
        rprint(comm, f"   (can't split {args.heads} heads x {args.layers} layers over {comm.size} ranks as "
               "tp x pp; try 1, 2, 4 or 8 ranks)")
        return True
    tp, pp = shape
    prompts = [enc(p) for p in PROMPTS[:PROMPT_COUNT]]
    n = NEW_TOKENS
    with measure(comm) as m:
        t0 = now()
        toks, logits = sharded_generate(comm, model, prompts, n, GREEDY, tp=tp, pp=pp, return_logits=True)
        dt = now() - t0
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
