"""One GPT training step (forward, backward, AdamW) in minidist vs PyTorch CPU eager, same run.

    python benchmarks/train_step.py [--steps 10] [--profile]

Model: vocab 256, 4 layers, d_model 256, 4 heads, sequence 128, batch 8, float32, one BLAS
thread. Both models start from the same weights. Prints median step times and the ratio
minidist / PyTorch (target <= 1.25), then (--profile) where minidist's time goes, by op.
Needs torch (`pip install torch==2.13.0`); without it, times minidist alone and says so.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402

from minidist import optim  # noqa: E402
from minidist.nn import GPT, GPTConfig  # noqa: E402

CFG = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, d_model=256, seed=0)
BATCH = 8


def minidist_step(model, opt, x, y):
    loss = model.loss(x, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def profile_ops(model, opt, x, y, steps=5):
    """Time spent in each op's forward and backward, summed over ``steps`` steps."""
    from collections import defaultdict

    from minidist.tensor import Function

    totals = defaultdict(float)
    originals = {}
    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    for cls in set(subclasses(Function)):
        for kind in ("forward", "backward"):
            fn = getattr(cls, kind)
            originals[(cls, kind)] = fn

            def timed(*a, _fn=fn, _key=f"{cls.__name__}.{kind}", **k):
                t0 = time.perf_counter()
                out = _fn(*a, **k)
                totals[_key] += time.perf_counter() - t0
                return out

            setattr(cls, kind, staticmethod(timed))
    try:
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = model.loss(x, y)
            opt.zero_grad()
            loss.backward()
            t1 = time.perf_counter()
            opt.step()
            totals["AdamW.step"] += time.perf_counter() - t1
        wall = time.perf_counter() - t0
    finally:
        for (cls, kind), fn in originals.items():
            setattr(cls, kind, staticmethod(fn))
    print(f"\nwhere minidist's step goes ({steps} steps, {wall / steps * 1e3:.0f} ms/step):")
    for key, sec in sorted(totals.items(), key=lambda kv: -kv[1])[:14]:
        print(f"  {key:<36} {sec / steps * 1e3:7.1f} ms  {sec / wall:6.1%}")
    print(f"  {'(engine overhead, the rest)':<36} {(wall - sum(totals.values())) / steps * 1e3:7.1f} ms")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
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
            print(f"  ratio minidist / PyTorch = {med['minidist'] / med['pytorch']:.2f} (target <= 1.25)")
        if args.profile:
            profile_ops(model, opt, x, y)
    if torch is not None and not agree:
        print("FAIL: minidist and PyTorch disagree on the first-step loss", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
