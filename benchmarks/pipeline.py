"""Pipeline bubble, measured: 2 MPI ranks (pp=2, one per core), m = 1, 2, 4, 8, 16 microbatches.

    mpirun -n 2 python benchmarks/pipeline.py            # (or plain `python benchmarks/pipeline.py`:
                                                         #  it relaunches itself under mpirun -n 2)

For each m: the measured bubble (idle share of 2 ranks x step time, forward/backward busy; median over
steps after a warm-up) beside (p-1)/(m+p-1), and the pipelined step time beside the single-process step
(rank 0 alone: forward + backward + update of the whole GPT on the same global batch). The model is
cut by per-layer time measured at each microbatch size (`partition_balanced`): the formula assumes
equal stages. The machine's load average is printed: other processes on the cores inflate waits.
Targets (issue 14), MET / MISSED for each m in 4..16: measured bubble within 0.05 of the formula, and
the speed-up over one process within 15% of the ideal m/(m+p-1) x p. Prints the CPU, the BLAS kernel
and the load average; exits nonzero on a miss only with --strict.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np

from minidist import trace
from minidist.comm import run, under_mpi
from minidist.nn import GPT, GPTConfig
from minidist.nn.optim import AdamW
from minidist.parallel.pipeline.runtime import format_partition, layer_costs
from minidist.parallel.pipeline.simulate import bubble_formula
from minidist.parallel.three_d import train_3d

BUBBLE_SLACK, SPEEDUP_SLACK = 0.05, 0.15


def serial_step_time(cfg, batches) -> float:
    model = GPT(cfg)
    opt = AdamW(model.parameters(), lr=1e-3)
    times = []
    for x, y in batches:
        t = time.perf_counter()
        model.loss(x, y).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
    return float(np.median(times[1:]))


def bench(comm, args):
    if comm.size != 2:
        raise SystemExit("run on 2 ranks: mpirun -n 2 python benchmarks/pipeline.py")
    cfg = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=4, d_model=args.width)
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 256, (args.batch, args.seq)), rng.integers(0, 256, (args.batch, args.seq)))
               for _ in range(args.steps)]
    if comm.rank == 0:
        from bench_env import print_machine

        print_machine()
        print(f"GPT {cfg.n_layer} blocks, d_model {cfg.d_model}, seq {cfg.block_size}, "
              f"global batch {args.batch}; 2 MPI ranks, pp=2, 1F1B; "
              f"median of {args.steps - 1} steps after a warm-up "
              f"(load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    rows = []
    for m in args.microbatches:  # the serial step is re-measured beside each m: the machine's load drifts
        serial = serial_step_time(cfg, batches) if comm.rank == 0 else None
        mb = batches[0][0][: args.batch // m]  # layer times at this microbatch size, shared by rank 0
        costs = comm.bcast_obj(layer_costs(GPT(cfg), mb, by="time") if comm.rank == 0 else None)
        tracer = trace.Tracer(comm.rank)
        marks, clock = [0], [time.perf_counter()]

        def mark(step, stats, marks=marks, tracer=tracer, clock=clock):
            marks.append(len(tracer.events))
            clock.append(time.perf_counter())
        comm.barrier()
        with trace.tracing(tracer):
            result = train_3d(comm, cfg, batches, pp=2, microbatches=m, schedule="1f1b", lr=1e-3,
                              optimizer="adamw", layer_costs=costs, on_step=mark)
        if comm.rank == 0 and args.verbose:
            print(f"m={m} partition:\n" + format_partition(result.bounds, costs, " s"))
        steps = [tracer.events[marks[s]:marks[s + 1]] for s in range(args.steps)]  # warm-up included
        everyone = comm.gather_obj(steps, root=0)
        times = np.diff(clock)[1:]  # this rank's step-to-step time: the pipeline's throughput
        if comm.rank == 0:
            bubble = trace.median_bubble(everyone, skip=1)  # forward/backward busy, warm-up step left out
            rows.append((m, bubble, bubble_formula(2, m), float(np.median(times)), serial))
    if comm.rank == 0:
        print(f"{'m':>3} {'bubble measured':>15} {'(p-1)/(m+p-1)':>13} {'diff':>6}   {'step ms':>8} "
              f"{'serial ms':>9} {'speedup':>7}")
        for m, b, f, t, serial in rows:
            print(f"{m:>3} {b:>15.3f} {f:>13.3f} {b - f:>+6.3f}   {t * 1e3:>8.1f} {serial * 1e3:>9.1f} "
                  f"{serial / t:>7.2f}x")
        from bench_env import Targets

        targets = Targets()
        for m, b, f, t, serial in rows:
            if 4 <= m <= 16:
                targets.check(f"m = {m}: |bubble - formula|", abs(b - f), "<=", BUBBLE_SLACK)
                ideal = m / (m + 1) * 2  # m / (m + p - 1) x p at p = 2
                targets.check(f"m = {m}: speed-up / ideal {ideal:.2f}x", serial / t / ideal, ">=",
                              1 - SPEEDUP_SLACK)
        return targets.exit_code(args.strict)
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--verbose", action="store_true", help="print each partition")
    p.add_argument("--strict", action="store_true", help="exit nonzero when a target is missed")
    args = p.parse_args(argv)
    if not under_mpi():
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
        cmd = ["mpirun", "-n", "2", sys.executable, os.path.abspath(__file__), *(argv or sys.argv[1:])]
        raise SystemExit(subprocess.call(cmd, env=env))
    return max(run(bench, args=args))


if __name__ == "__main__":
    sys.exit(main())
