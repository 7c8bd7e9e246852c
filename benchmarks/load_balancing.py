"""Load balancing against the static baseline, side by side in one run.

    python benchmarks/load_balancing.py [--ranks 4] [--pace 0.008] [--mpi] [--strict]

1. Data parallelism, one rank 3x slower from step 3 (``MINIDIST_SLOW``-style, emulated): equal
   shares (static) vs throughput-proportional shares (rebalanced). Target: after rebalancing the
   step time is within 15% of the balanced time B / Σ s_i (both printed, beside the static one).
2. Pipeline, two layers of one stage 4x heavier: the uniform cut (static) vs the min-max cut found
   while training; step time and bubble before and after, beside the 1F1B formula
   T = Σ c_s / m + (m-1) max c_s / m. Target: the re-partitioned step is shorter than the static one.
3. Serving on 3 replicas, one 3x slower: round-robin vs least-loaded routing; p50/p99 latency and
   throughput; the same tokens for every request. Target: least-loaded's p99 below round-robin's.

Prints the CPU, the load average and MET/MISSED per target; exits nonzero on a miss only with
``--strict``. ``--pace`` emulates a device at that many seconds per row (0: time the real compute;
on a machine with fewer cores than ranks, the real compute's contention is then what you measure).
``--mpi`` runs the ranks as ``mpirun -n RANKS`` processes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_env import clock_flags, use_clock  # noqa: E402

from minidist.comm import run, under_mpi  # noqa: E402
from minidist.infer import Request  # noqa: E402
from minidist.infer.router import poisson_arrivals, route  # noqa: E402
from minidist.nn import GPT, GPTConfig  # noqa: E402
from minidist.parallel.balance.dp import train_dp_balanced  # noqa: E402
from minidist.parallel.balance.pipeline import train_pipeline_balanced  # noqa: E402
from minidist.parallel.balance.repartition import stage_costs, step_time  # noqa: E402
from minidist.parallel.pipeline.partition import partition_uniform  # noqa: E402
from minidist.plan.calibrate import cpu_name  # noqa: E402
from minidist.resilience.stragglers import Slowdown  # noqa: E402

TARGET = 0.15


def _batches(rows, steps, seed, vocab=32, seq=8):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, vocab, (rows, seq)), rng.integers(0, vocab, (rows, seq))) for _ in range(steps)]


def _med(xs) -> float:
    """Median, or NaN for no values (a run too short to reach the phase)."""
    return float(np.median(xs)) if len(xs) else float("nan")


def data_parallel(comm, args) -> dict:
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, d_model=16, dtype="float64")
    batches = _batches(args.batch, args.steps, 0)
    slow_rank, start = min(2, comm.size - 1), 3
    slow = Slowdown(f"rank={slow_rank},factor=3,from_step={start}", pace=args.pace)
    static = train_dp_balanced(comm, cfg, batches, slow=slow, balance=False)
    moving = train_dp_balanced(comm, cfg, batches, slow=slow, every=2, window=2)
    moved = [k for k in range(1, len(moving.shares)) if moving.shares[k] != moving.shares[k - 1]]
    settle = (moved[-1] + 1) if moved else len(batches)
    return {"static": _med(static.step_seconds[start + 1:]), "balanced": _med(moving.step_seconds[settle:]),
            "ideal": _med(moving.ideal_seconds[settle:]), "before": _med(static.step_seconds[1:start]),
            "shares": moving.shares[-1], "slow_rank": slow_rank,
            "same": bool(np.allclose(static.losses, moving.losses, rtol=0, atol=1e-9))}


def pipeline(comm, args) -> dict:
    p = comm.size
    n = max(8, 2 * p)
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=n - 2, n_head=2, d_model=16, dtype="float64")
    batches = _batches(args.microbatches, args.pp_steps, 1)
    first = partition_uniform(n, p)[1][0]
    slow = Slowdown(f"layer={first},factor=4;layer={first + 1},factor=4", pace=args.pace / 2)
    static = train_pipeline_balanced(comm, cfg, batches, microbatches=args.microbatches, slow=slow,
                                     balance=False)
    moving = train_pipeline_balanced(comm, cfg, batches, microbatches=args.microbatches, slow=slow,
                                     every=2, window=1)
    after = (moving.moves[0][0] + 2) if moving.moves else len(batches)
    m = args.microbatches

    def formula(r, k):
        sc = stage_costs(r.bounds[k], np.array(r.layer_seconds[k]))
        return step_time(sc, m), 1 - sum(sc) / (p * step_time(sc, m))
    tail = list(range(after, len(batches)))
    steady = range(1, len(batches))
    return {"static": _med(static.step_seconds[1:]), "balanced": _med([moving.step_seconds[k] for k in tail]),
            "static_formula": _med([formula(static, k)[0] for k in steady]),
            "static_bubble": _med([formula(static, k)[1] for k in steady]),
            "balanced_formula": _med([formula(moving, k)[0] for k in tail]),
            "balanced_bubble": _med([formula(moving, k)[1] for k in tail]),
            "bounds": (static.bounds[0], moving.bounds[-1]), "moves": len(moving.moves),
            "same": bool(np.allclose(static.losses, moving.losses, rtol=0, atol=1e-9))}


def ranks(comm, args):
    return data_parallel(comm, args), pipeline(comm, args)


def serving(args) -> dict:
    model = GPT(GPTConfig(vocab_size=32, block_size=48, n_layer=2, n_head=2, d_model=32, seed=2))
    rng = np.random.default_rng(0)
    reqs = [Request(i, rng.integers(0, 32, int(rng.integers(2, 10))).tolist(), int(rng.integers(4, 16)))
            for i in range(args.requests)]
    arrivals = poisson_arrivals(len(reqs), rate=args.rate, seed=1)
    slow = Slowdown("rank=1,factor=3", pace=args.pace / 8)
    out = {pol: route(model, reqs, arrivals, replicas=3, policy=pol, slow=slow)
           for pol in ("round_robin", "least_loaded")}
    out["same"] = out["round_robin"].outputs == out["least_loaded"].outputs
    return out


def report(args, dp, pp, sv) -> bool:
    ms = 1e3
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f}; "
          f"{args.ranks} ranks ({'mpi' if under_mpi() else 'threads'}); device pace {args.pace * ms:g} "
          "ms/row\n")
    ok_dp = dp["balanced"] <= (1 + TARGET) * dp["ideal"]
    print(f"1. data parallel, rank {dp['slow_rank']} 3x slower from step 3, global batch {args.batch} rows")
    print(f"   before the slowdown        {dp['before'] * ms:8.1f} ms/step")
    print(f"   static (equal shares)      {dp['static'] * ms:8.1f} ms/step")
    print(f"   rebalanced {str(dp['shares']):<15} {dp['balanced'] * ms:8.1f} ms/step  "
          f"({dp['static'] / dp['balanced']:.2f}x faster than static)")
    print(f"   balanced time B / sum(s_i) {dp['ideal'] * ms:8.1f} ms: rebalanced is "
          f"{dp['balanced'] / dp['ideal']:.2f}x it (target <= {1 + TARGET:.2f}x) "
          f"{'MET' if ok_dp else 'MISSED'}; same losses: {dp['same']}")
    ok_pp = pp["balanced"] < pp["static"]
    print(f"\n2. pipeline, {args.ranks} stages, {args.microbatches} microbatches, two layers of stage 1 "
          "4x heavier")
    print(f"   static {str(pp['bounds'][0]):<34} {pp['static'] * ms:8.1f} ms/step (formula "
          f"{pp['static_formula'] * ms:.1f}, bubble {pp['static_bubble']:.2f})")
    print(f"   re-cut {str(pp['bounds'][1]):<34} {pp['balanced'] * ms:8.1f} ms/step (formula "
          f"{pp['balanced_formula'] * ms:.1f}, bubble {pp['balanced_bubble']:.2f})")
    print(f"   re-partitioned step shorter than static: {'MET' if ok_pp else 'MISSED'} "
          f"({pp['static'] / pp['balanced']:.2f}x); same losses: {pp['same']}")
    rr, ll = sv["round_robin"], sv["least_loaded"]
    ok_sv = ll.percentile(99) < rr.percentile(99) and sv["same"]
    print(f"\n3. serving, 3 replicas (replica 1 3x slower), {args.requests} requests at {args.rate:g}/s")
    for name, r in (("round-robin", rr), ("least-loaded", ll)):
        counts = np.bincount([v for v in r.replica_of.values() if v is not None], minlength=3).tolist()
        print(f"   {name:<13} p50 {r.percentile(50) * ms:7.1f} ms  p99 {r.percentile(99) * ms:7.1f} ms  "
              f"{r.throughput:7.0f} tokens/s  requests per replica {counts}")
    print(f"   least-loaded p99 below round-robin's, same tokens ({sv['same']}): "
          f"{'MET' if ok_sv else 'MISSED'}")
    return ok_dp and ok_pp and ok_sv


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--pace", type=float, default=0.008, help="emulated device seconds per row (0: off)")
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--pp-steps", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--rate", type=float, default=100.0, help="request arrivals per second")
    ap.add_argument("--mpi", action="store_true", help="run the ranks under mpirun -n RANKS")
    ap.add_argument("--strict", action="store_true", help="exit nonzero if a target is missed")
    clock_flags(ap)
    args = ap.parse_args(argv)
    clock = use_clock(args)
    if args.mpi and not under_mpi():
        cmd = ["mpirun", "-n", str(args.ranks), sys.executable, __file__] + \
            [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--mpi"]
        sys.exit(subprocess.run(cmd, env=dict(os.environ, OPENBLAS_NUM_THREADS="1")).returncode)
    results = run(ranks, ranks=None if under_mpi() else args.ranks, args=args)
    if under_mpi():
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_rank() != 0:
            return
    dp, pp = results[0]
    print(clock)
    ok = report(args, dp, pp, serving(args))
    if args.strict and not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
