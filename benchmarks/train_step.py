"""One GPT training step (forward, backward, AdamW) in minidist vs PyTorch CPU eager, same run.

    python benchmarks/train_step.py [--steps 10] [--profile] [--strict]

Model: vocab 256, 4 layers, d_model 256, 4 heads, sequence 128, batch 8, float32, one BLAS
thread. Both models start from the same weights. Prints the machine (CPU, BLAS kernel, load),
median step times and the ratio minidist / PyTorch (target <= 1.0, MET / MISSED), then
(--profile) the time per op beside PyTorch's own profiler on the same step: matmul, attention,
GELU, layer norm, cross-entropy, embedding, the rest, and the AdamW step, with the ratio per row.
Exits nonzero on a missed target only under --strict. Needs torch (`pip install torch==2.13.0`);
without it, times minidist alone and says so. To benchmark where OPENBLAS_CORETYPE /
OPENBLAS_L2_SIZE are set, unset both for this command alone (the printed BLAS line shows the kernel).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from bench_env import Targets, clock_flags, print_machine, use_clock  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402

from minidist.nn import (  # noqa: E402
    GPT,
    GPTConfig,
    optim,  # noqa: E402
)

CFG = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, d_model=256, seed=0)
BATCH = 8
TARGET = 1.0  # minidist's step time over PyTorch's (issue 14)


def minidist_step(model, opt, x, y):
    loss = model.loss(x, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


# op -> the row it is reported under; minidist's by Function class, PyTorch's by aten op name
ROWS = ("matmul (linear)", "attention", "GELU", "layer norm", "cross-entropy", "embedding",
        "other ops", "engine + Python (the rest)", "AdamW step")
MINIDIST_ROW = {"Linear": "matmul (linear)", "Matmul": "matmul (linear)",
                "ScaledDotProductAttention": "attention", "PackedAttention": "attention", "Gelu": "GELU",
                "LayerNorm": "layer norm",
                "CrossEntropy": "cross-entropy",
                "Embedding": "embedding"}
TORCH_ROW = (("scaled_dot_product", "attention"), ("flash_attention", "attention"),
             ("addmm", "matmul (linear)"), ("aten::mm", "matmul (linear)"), ("aten::bmm", "matmul (linear)"),
             ("gelu", "GELU"), ("layer_norm", "layer norm"), ("log_softmax", "cross-entropy"),
             ("nll_loss", "cross-entropy"), ("embedding", "embedding"))


def _torch_row(name: str) -> str:
    return next((row for key, row in TORCH_ROW if key in name), "other ops")


def profile_minidist(model, opt, x, y, steps):
    """ms per step in each row: every Function's forward and backward timed by wrapping them."""
    from collections import defaultdict

    from minidist.autograd.tensor import Function

    totals, originals = defaultdict(float), {}

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    for cls in set(subclasses(Function)):
        for kind in ("forward", "backward"):
            fn = getattr(cls, kind)
            originals[(cls, kind)] = fn
            row = MINIDIST_ROW.get(cls.__name__, "other ops")

            def timed(*a, _fn=fn, _row=row, **k):
                t0 = time.perf_counter()
                out = _fn(*a, **k)
                totals[_row] += time.perf_counter() - t0
                return out

            setattr(cls, kind, staticmethod(timed))
    fwd_bwd = 0.0
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            loss = model.loss(x, y)
            opt.zero_grad()
            loss.backward()
            t1 = time.perf_counter()
            opt.step()
            totals["AdamW step"] += time.perf_counter() - t1
            fwd_bwd += t1 - t0
    finally:
        for (cls, kind), fn in originals.items():
            setattr(cls, kind, staticmethod(fn))
    totals["engine + Python (the rest)"] = fwd_bwd - sum(v for k, v in totals.items() if k != "AdamW step")
    return {k: v / steps * 1e3 for k, v in totals.items()}


def profile_torch(torch, model, opt, x, y, steps):
    """ms per step in each row: torch.profiler's self CPU time of every aten op, forward and backward
    (self time, so nothing is counted twice); the optimizer step timed apart, like minidist's."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile

    totals, fwd_bwd = defaultdict(float), 0.0
    for _ in range(steps):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            loss = model(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            fwd_bwd += time.perf_counter() - t0
        for ev in prof.key_averages():
            totals[_torch_row(ev.key)] += ev.self_cpu_time_total / 1e6
        t1 = time.perf_counter()
        opt.step()
        totals["AdamW step"] += time.perf_counter() - t1
    totals["engine + Python (the rest)"] = fwd_bwd - sum(v for k, v in totals.items() if k != "AdamW step")
    return {k: v / steps * 1e3 for k, v in totals.items()}


def print_profiles(mine, theirs):
    print("\nwhere the step goes, op by op (ms per step; PyTorch from torch.profiler, self CPU time):")
    print(f"  {'op':<28} {'minidist':>9} {'PyTorch':>9} {'ratio':>7}")
    for row in ROWS:
        a, b = mine.get(row, 0.0), (theirs or {}).get(row)
        ratio = f"{a / b:7.2f}" if b else "      -"
        print(f"  {row:<28} {a:9.1f} {b if b is not None else float('nan'):9.1f} {ratio}"
              + ("  <- behind" if b and a > 1.1 * b and a - b > 1.0 else ""))
    total_a = sum(mine.values())
    total_b = sum(theirs.values()) if theirs else float("nan")
    print(f"  {'total (profiled)':<28} {total_a:9.1f} {total_b:9.1f}")
    if theirs:
        rest_a, rest_b = total_a - mine.get(ROWS[0], 0.0), total_b - theirs.get(ROWS[0], 0.0)
        print(f"  {'all but matmul':<28} {rest_a:9.1f} {rest_b:9.1f} {rest_a / rest_b:7.2f}"
              "  (the engine's own share: matmul speed is mostly the BLAS, see below)")


def blas_alone(torch, n=1024, k=256, m=1024, repeats=20):
    """GFLOP/s of one (n, k) @ (k, m) float32 GEMM, NumPy's BLAS and PyTorch's, one thread each."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, k), dtype=np.float32), rng.standard_normal((k, m), dtype=np.float32)
    out = {}
    for name, (x, y) in (("NumPy", (a, b)), ("PyTorch", (torch.from_numpy(a), torch.from_numpy(b)))):
        x @ y
        t = min(_timed(lambda x=x, y=y: x @ y) for _ in range(repeats))
        out[name] = 2 * n * k * m / t / 1e9
    print(f"the same GEMM alone ({n}x{k} @ {k}x{m}, fp32, 1 thread): "
          + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in out.items()))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profile", action="store_true",
                    help="also compare the time per op with torch.profiler's on the same step")
    ap.add_argument("--strict", action="store_true", help="exit nonzero when a target is missed")
    ap.add_argument("--backend", choices=["numpy", "jax"], default="numpy",
                    help="jax: minidist on JAX vs on NumPy vs a pure jax.jit step (benchmarks/jax_step.py)")
    clock_flags(ap)
    args = ap.parse_args(argv)
    use_clock(args, wall_only="its references are PyTorch's eager step and JAX's jit, which only the "
                              "wall clock can time")
    if args.backend == "jax":
        from jax_step import run as jax_run

        print_machine()
        return jax_run(CFG, BATCH, args.steps)
    print_machine()
    targets = Targets()
    rng = np.random.default_rng(0)
    x = rng.integers(0, CFG.vocab_size, (BATCH, CFG.block_size))
    y = rng.integers(0, CFG.vocab_size, (BATCH, CFG.block_size))
    model = GPT(CFG)
    sd = {k: v.copy() for k, v in model.state_dict().items()}
    opt = optim.AdamW(model.parameters(), lr=1e-4)

    try:
        import torch
        from torch_gpt import from_minidist

        torch.set_num_threads(1)
        tmodel = from_minidist(sd, CFG)
        topt = torch.optim.AdamW(tmodel.parameters(), lr=1e-4, weight_decay=0.01)
        tx, ty = torch.from_numpy(x), torch.from_numpy(y)

        def torch_step():
            loss = tmodel(tx, ty)
            topt.zero_grad(set_to_none=True)
            loss.backward()
            topt.step()
            return loss.item()
    except ImportError:
        torch = None
        print("torch is not installed (pip install torch==2.13.0): timing minidist alone")

    with threadpool_limits(1):
        first_md = minidist_step(model, opt, x, y)
        if torch is not None:
            first_t = torch_step()
            agree = abs(first_md - first_t) <= 1e-4 * abs(first_t)
            print(f"first-step loss: minidist {first_md:.6f}  PyTorch {first_t:.6f}  "
                  f"(same weights and batch: they must agree) {'PASS' if agree else 'FAIL'}")
        times = {"minidist": [], "pytorch": []}
        for _ in range(args.steps):  # interleaved, so drift on the shared machine hits both alike
            t0 = time.perf_counter()
            minidist_step(model, opt, x, y)
            times["minidist"].append(time.perf_counter() - t0)
            if torch is not None:
                t0 = time.perf_counter()
                torch_step()
                times["pytorch"].append(time.perf_counter() - t0)
        med = {k: float(np.median(v)) * 1e3 for k, v in times.items() if v}
        print(f"GPT step (vocab 256, 4 layers, d 256, 4 heads, seq 128, batch 8, fp32, 1 thread), "
              f"median of {args.steps}:")
        for k, v in med.items():
            print(f"  {k:<9} {v:8.1f} ms")
        if "pytorch" in med:
            targets.check("GPT train step, minidist / PyTorch CPU eager", med["minidist"] / med["pytorch"],
                          "<=", TARGET)
        if args.profile:
            mine = profile_minidist(model, opt, x, y, steps=5)
            theirs = profile_torch(torch, tmodel, topt, tx, ty, steps=5) if torch is not None else None
            print_profiles(mine, theirs)
            if torch is not None:
                blas_alone(torch)
    if torch is not None and not agree:
        print("FAIL: minidist and PyTorch disagree on the first-step loss", file=sys.stderr)
        return 1
    return targets.exit_code(args.strict)


if __name__ == "__main__":
    sys.exit(main())
