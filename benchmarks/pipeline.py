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

Zero bubble (issue 31): the simulator's bubble for 1F1B and ZB-H1 with F = B = W at p = 2, 4 and
m = 4, 8 beside their formulas (p-1)/(m+p-1) and (p-1)/(3m+p-1) (MET within 0.05), then ZB-H1 run
on the same 2 ranks at m = 4, 8: measured bubble beside its formula and the step time over 1F1B's
(MET when ZB-H1 is not slower than 1F1B by more than 5%).
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
from minidist.parallel.pipeline.schedule import one_f_one_b
from minidist.parallel.pipeline.simulate import bubble_formula, simulate
from minidist.parallel.pipeline.zero_bubble import zb_h1, zb_h1_bubble_formula
from minidist.parallel.three_d import train_3d

BUBBLE_SLACK, SPEEDUP_SLACK, ZB_SLOWER = 0.05, 0.15, 0.05
BUSY = ("Forward", "Backward", "BackwardInput", "BackwardWeight")


def simulated_zero_bubble(targets) -> None:
    """1F1B and ZB-H1 simulated with F = B = W = 1 (1F1B's backward is B + W = 2) beside their formulas."""
    print(f"\n{'p':>2} {'m':>3} {'1F1B sim':>8} {'formula':>8}   {'ZB-H1 sim':>9} {'(p-1)/(3m+p-1)':>14}")
    for p in (2, 4):
        for m in (4, 8):
            ob = simulate(one_f_one_b(p, m), fwd_time=1, bwd_time=2).bubble
            zb = simulate(zb_h1(p, m), fwd_time=1, input_time=1, weight_time=1, buffered_sends=True).bubble
            print(f"{p:>2} {m:>3} {ob:>8.3f} {bubble_formula(p, m):>8.3f}   {zb:>9.3f} "
                  f"{zb_h1_bubble_formula(p, m):>14.3f}")
            targets.check(f"p = {p}, m = {m}: |1F1B sim - formula|", abs(ob - bubble_formula(p, m)), "<=",
                          BUBBLE_SLACK)
            targets.check(f"p = {p}, m = {m}: |ZB-H1 sim - formula|", abs(zb - zb_h1_bubble_formula(p, m)),
                          "<=", BUBBLE_SLACK)


def timed_run(comm, cfg, batches, m, schedule, costs, args):
    """One run under `schedule`: (on rank 0 (bubble, median step seconds), else None; the result)."""
    tracer = trace.Tracer(comm.rank)
    marks, clock = [0], [time.perf_counter()]

    def mark(step, stats):
        marks.append(len(tracer.events))
        clock.append(time.perf_counter())
    comm.barrier()
    with trace.tracing(tracer):
        result = train_3d(comm, cfg, batches, pp=2, microbatches=m, schedule=schedule, lr=1e-3,
                          optimizer="adamw", layer_costs=costs, on_step=mark)
    steps = [tracer.events[marks[s]:marks[s + 1]] for s in range(args.steps)]  # warm-up included
    everyone = comm.gather_obj(steps, root=0)
    times = np.diff(clock)[1:]  # this rank's step-to-step time: the pipeline's throughput
    if comm.rank != 0:
        return None, result
    return (trace.median_bubble(everyone, skip=1, names=BUSY), float(np.median(times))), result


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
    rows, zb_rows = [], []
    for m in args.microbatches:  # the serial step is re-measured beside each m: the machine's load drifts
        serial = serial_step_time(cfg, batches) if comm.rank == 0 else None
        mb = batches[0][0][: args.batch // m]  # layer times at this microbatch size, shared by rank 0
        costs = comm.bcast_obj(layer_costs(GPT(cfg), mb, by="time") if comm.rank == 0 else None)
        measured, result = timed_run(comm, cfg, batches, m, "1f1b", costs, args)
        if comm.rank == 0 and args.verbose:
            print(f"m={m} partition:\n" + format_partition(result.bounds, costs, " s"))
        if m in (4, 8):
            zb, _ = timed_run(comm, cfg, batches, m, "zb-h1", costs, args)
            if comm.rank == 0:
                zb_rows.append((m, zb[0], zb_h1_bubble_formula(2, m), zb[1], measured[1]))
        if comm.rank == 0:
            rows.append((m, measured[0], bubble_formula(2, m), measured[1], serial))
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
        simulated_zero_bubble(targets)
        print(f"\nZB-H1 on these 2 ranks:\n{'m':>3} {'bubble measured':>15} {'(p-1)/(3m+p-1)':>14}   "
              f"{'ZB-H1 ms':>8} {'1F1B ms':>8} {'1F1B/ZB-H1':>10}")
        for m, b, f, t, t_ob in zb_rows:
            print(f"{m:>3} {b:>15.3f} {f:>14.3f}   {t * 1e3:>8.1f} {t_ob * 1e3:>8.1f} {t_ob / t:>9.2f}x")
            targets.check(f"m = {m}: ZB-H1 step / 1F1B step", t / t_ob, "<=", 1 + ZB_SLOWER)
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
