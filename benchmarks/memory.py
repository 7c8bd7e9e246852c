"""Memory techniques measured: activation recomputation policies and disk-offloaded AdamW.

    python benchmarks/memory.py [--repeats 5] [--layers 8]

Model: the core benchmark's GPT (vocab 256, d_model 256, 4 heads, sequence 128, batch 8, float32,
one BLAS thread) with 8 layers. For none / full (every block) / sqrt(n) / selective recomputation:
the measured peak bytes of activations saved for backward (``minidist.nn.footprint.MemoryAccountant``)
beside the formula, and the median step time (forward + backward), wall clock and this thread's
CPU time (steadier on a shared machine; the target is judged on it). Then one training step
(forward, backward, AdamW) with AdamW's m and v in memmap files vs in memory. Variants are timed
interleaved (A B C A B C ...) so a busy machine slows them alike. Targets: full recomputation cuts
peak activations >= 3x at <= 1.45x step time; disk offload costs <= 1.3x step time.
The reference: PyTorch CPU with ``torch.utils.checkpoint`` on the same model shape (needs torch;
skipped, saying so, when torch is absent).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from bench_env import Targets, print_machine  # noqa: E402

from minidist.nn import GPT, GPTConfig  # noqa: E402
from minidist.nn.footprint import MemoryAccountant  # noqa: E402
from minidist.nn.optim import AdamW  # noqa: E402
from minidist.parallel.memory import recompute  # noqa: E402
from minidist.parallel.memory.offload import OffloadedAdamW  # noqa: E402
from minidist.parallel.memory.recompute import apply_recompute, predicted_peak_activation_bytes  # noqa: E402

POLICIES = tuple(q for q in recompute.POLICIES if q != "every_k")  # every_k needs a k: sqrt picks one


def interleaved(fns: dict, repeats: int, clock=time.perf_counter) -> dict:
    """Median seconds of each fn by ``clock``, timed round-robin after one warm-up each."""
    for f in fns.values():
        f()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = clock()
            f()
            times[k].append(clock() - t0)
    return {k: float(np.median(v)) for k, v in times.items()}


def both(fns: dict, repeats: int, cpu_clock) -> tuple[dict, dict]:
    """(wall, cpu) medians: on a shared machine the CPU time is the steadier of the two."""
    return interleaved(fns, repeats), interleaved(fns, repeats, cpu_clock)


def torch_ratios(cfg, batch, x, repeats):
    try:
        import torch
        from torch.utils.checkpoint import checkpoint
    except ImportError:
        return None
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from torch_gpt import from_minidist

    torch.set_num_threads(1)
    sd = {k: np.asarray(v) for k, v in GPT(cfg).state_dict().items()}
    xt = torch.from_numpy(x)
    models = {}
    for policy in ("none", "full"):
        m = from_minidist(sd, cfg)
        if policy == "full":
            for blk in m.blocks:
                blk.forward = (lambda f: lambda h: checkpoint(f, h, use_reentrant=False))(blk.forward)
        models[policy] = m

    def step(m):
        def run():
            m.zero_grad()
            m(xt, xt).backward()
        return run
    return interleaved({k: step(m) for k, m in models.items()}, repeats, time.thread_time)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--offload-dir", default=tempfile.gettempdir())
    ap.add_argument("--strict", action="store_true", help="exit nonzero when a target is missed")
    args = ap.parse_args(argv)
    print_machine()
    targets = Targets()
    cfg = GPTConfig(vocab_size=256, block_size=128, n_layer=args.layers, n_head=4, d_model=256, seed=0)
    batch = 8
    x = np.random.default_rng(0).integers(0, 256, (batch, cfg.block_size))
    print(f"GPT {cfg.n_layer} layers, d_model {cfg.d_model}, {cfg.n_head} heads, T {cfg.block_size}, "
          f"batch {batch}, float32; median of {args.repeats} interleaved runs\n")

    models = {p: apply_recompute(GPT(cfg), p) for p in POLICIES}
    peaks = {}
    for p, m in models.items():
        acct = MemoryAccountant()
        with acct.track_activations(m):
            m.loss(x, x).backward()
        peaks[p] = acct.peak_activation_bytes
        m.zero_grad()

    def fb(m):
        def run():
            m.zero_grad()
            m.loss(x, x).backward()
        return run
    wall, times = both({p: fb(m) for p, m in models.items()}, args.repeats, time.thread_time)
    print(f"{'policy':<10} {'peak act MiB':>12} {'formula MiB':>11} {'cut':>6} {'wall ms':>8} {'ratio':>6} "
          f"{'cpu ms':>8} {'ratio':>6}")
    for p in POLICIES:
        f = predicted_peak_activation_bytes(cfg, batch, cfg.block_size, p)
        print(f"{p:<10} {peaks[p] / 2**20:>12.2f} {f / 2**20:>11.2f} {peaks['none'] / peaks[p]:>5.2f}x "
              f"{wall[p] * 1e3:>8.1f} {wall[p] / wall['none']:>5.2f}x "
              f"{times[p] * 1e3:>8.1f} {times[p] / times['none']:>5.2f}x")
    ref = torch_ratios(cfg, batch, x, args.repeats)
    if ref is None:
        print("PyTorch reference: skipped (torch is not installed)")
    else:
        print("PyTorch CPU reference (torch.utils.checkpoint, every block; cpu time): "
              f"none {ref['none'] * 1e3:.1f} ms, full {ref['full'] * 1e3:.1f} ms: "
              f"{ref['full'] / ref['none']:.2f}x")
        print(f"no recomputation, {cfg.n_layer} layers, cpu time: minidist {times['none'] * 1e3:.1f} ms vs "
              f"PyTorch {ref['none'] * 1e3:.1f} ms: {times['none'] / ref['none']:.2f}x")
    targets.check("full recomputation: activation memory cut", peaks["none"] / peaks["full"], ">=", 3)
    targets.check("full recomputation: (cpu) time ratio", times["full"] / times["none"], "<=", 1.45)
    print()

    mem_model, off_model = GPT(cfg), GPT(cfg)
    mem_opt = AdamW(mem_model.parameters(), lr=1e-4)
    with OffloadedAdamW(off_model.parameters(), args.offload_dir, lr=1e-4) as off_opt:
        def train(m, o):
            def run():
                o.zero_grad()
                m.loss(x, x).backward()
                o.step()
            return run
        t, cpu = both({"memory": train(mem_model, mem_opt), "disk": train(off_model, off_opt)},
                      args.repeats, time.process_time)  # process: the helper thread's work counts
        pairs = zip(mem_model.parameters(), off_model.parameters())
        same = all(np.array_equal(a.data, b.data) for a, b in pairs)
        state = 8 * mem_model.num_parameters()
        ratio = t["disk"] / t["memory"]
        print(f"AdamW state {state / 2**20:.1f} MiB: in memory {t['memory'] * 1e3:.1f} ms/step; memmap files "
              f"in {args.offload_dir} {t['disk'] * 1e3:.1f} ms/step: {ratio:.2f}x; resident state at most "
              f"{off_opt.resident_peak / 2**20:.1f} MiB; parameters bit-identical: {same}")
        print(f"  cpu time (all threads): in memory {cpu['memory'] * 1e3:.1f} ms, "
              f"disk {cpu['disk'] * 1e3:.1f} ms: {cpu['disk'] / cpu['memory']:.2f}x")
        targets.check("disk-offloaded AdamW step time ratio", ratio, "<=", 1.3)
    if not same:  # a correctness check, unlike the timing targets: the exit status says so
        print("FAIL: disk-offloaded AdamW's parameters differ from in-memory AdamW's", file=sys.stderr)
        return 1
    return targets.exit_code(args.strict)


if __name__ == "__main__":
    sys.exit(main())
