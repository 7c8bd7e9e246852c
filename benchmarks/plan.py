"""The planner against measurement here and published runs there.

    python benchmarks/plan.py [--mpi] [--calibrate] [--strict]

1. Here: `python -m minidist.calibrate` constants (run first if missing; `--calibrate`: in the same
   run, right before measuring, so calibration and measurement see the same load; `--calibrate each`:
   right before every row), then small minidist GPT
   trainings on the threads transport for several meshes (`--mpi`: each mesh as `mpirun -n N`
   processes, more of them than this machine has cores for the larger meshes); measured median
   step time vs the planner's prediction with `--hardware here` (target: within 30%). The load
   average at calibration and before each row is printed: other programs on the machine take cores
   the calibration did not see, or gave back cores it did not get.
2. There: the published runs of `minidist.plan.presets.RUNS`, predicted vs reported (target: 25%);
   with --compare, the planner's own best mesh for each and why it differs from the paper's.
Prints MET/MISSED per row; exits nonzero on a miss only with --strict.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import numpy as np
from bench_env import clock_flags, print_machine, use_clock
from threadpoolctl import threadpool_limits

from minidist.comm import run
from minidist.nn.gpt import GPTConfig
from minidist.plan import RUNS, Candidate, ModelSpec, hardware, predict
from minidist.plan.calibrate import calibrate, step_seconds

MESHES = [(1, 1, 1, 1), (2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 4), (4, 1, 1, 1), (2, 2, 2, 2), (8, 1, 1, 1)]
CFG = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, d_model=128)
SPEC = ModelSpec.of_gpt("bench", CFG)
BATCH = 16


def measure_here(cfg, batch, dp, tp, pp, m, steps=8):
    """Median step time (the slowest rank's, first step dropped) of `train_3d` on this process's
    transport: dp·tp·pp thread ranks, or under mpirun the job's processes."""
    rng = np.random.default_rng(0)
    data = [(rng.integers(0, cfg.vocab_size, (batch, cfg.block_size)),) * 2 for _ in range(steps)]

    def body(comm):  # (the warm-up step dropped)
        return np.max(comm.allgather_obj(step_seconds(comm, cfg, data, dp=dp, pp=pp, tp=tp, microbatches=m)),
                      axis=0)
    with threadpool_limits(1):  # one BLAS thread per rank, also for a single rank (what the planner assumes)
        return float(np.median(run(body, ranks=dp * tp * pp)[0]))


def measure_mpi(dp, tp, pp, m) -> float:
    """The same under `mpirun -n dp·tp·pp` (this script with --measure): one BLAS thread per process."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    cmd = ["mpirun", "-n", str(dp * tp * pp), sys.executable, os.path.abspath(__file__), "--measure",
           *map(str, (dp, tp, pp, m))]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("step ")]
    if out.returncode or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    return float(lines[0].split()[1])


def hw_load() -> float:
    import json

    with open(hardware.CALIBRATION_PATH) as f:
        return float(json.load(f).get("load", float("nan")))


def here_rows(args):
    if args.calibrate or not os.path.exists(hardware.CALIBRATION_PATH):
        calibrate()
    transport = "mpi" if args.mpi else "threads"
    hw = hardware.here(transport=transport)
    if args.mpi:
        crowds = ", ".join(f"{c.ranks}: {c.cores:.1f} (+{c.python:.2f})" for c in hw.crowds) or \
            "not probed: recalibrate"
        print(f"here: {hw.name}, MPI processes ({hw.cpus} CPUs; one rank alone gets {hw.cores_one:.2f} of a "
              f"core; cores' worth (+Python lost per s) per process count {crowds})", end="")
    else:
        counts = ", ".join(f"{n}: {c:.1f}" for n, c in hw.threads) or f"{hw.cores:.1f}"
        print(f"here: {hw.name}, thread ranks ({hw.cpus} CPUs; cores' worth per rank count {counts})", end="")
    print(f", load average now {os.getloadavg()[0]:.1f} (calibrated at {hw_load():.1f}); "
          f"GPT {CFG.n_layer}x{CFG.d_model}, batch {BATCH}x{CFG.block_size}")
    print(f"{'mesh':<22} {'predicted s':>11} {'measured s':>10} {'ratio':>6}  within 30%  "
          "load (calibrated at)")
    ok = True
    for i, (dp, tp, pp, m) in enumerate(MESHES):
        if args.calibrate == "each" and i:  # the first row's is the one above
            calibrate()
            hw = hardware.here(transport=transport)
        cand = Candidate(dp=dp, tp=tp, pp=pp, microbatch_size=BATCH // (dp * m))
        pred = predict(SPEC, cand, BATCH, hw).step
        load = os.getloadavg()[0]
        meas = measure_mpi(dp, tp, pp, m) if args.mpi else measure_here(CFG, BATCH, dp, tp, pp, m)
        r = pred / meas
        met = abs(r - 1) <= 0.30
        ok &= met
        print(f"dp{dp} tp{tp} pp{pp} m{m:<10} {pred:>11.4f} {meas:>10.4f} {r:>6.2f}  "
              f"{'MET' if met else 'MISSED':<10}  {load:.1f} ({hw_load():.1f})", flush=True)
    return ok


def published_rows():
    print(f"\n{'published run':<14} {'chips':>6} {'metric':<16} {'reported':>9} {'predicted':>9} "
          f"{'ratio':>6} fits  within 25%")
    ok = True
    for name, r in RUNS.items():
        mesh = dict(r.mesh)
        cand = Candidate(microbatch_size=mesh.pop("microbatch_size"), **mesh)
        p = predict(r.model, cand, r.global_batch, r.hardware)
        if r.metric == "tflops_per_chip":
            got = p.tflops_per_chip
        else:
            got = p.mfu
        ratio = got / r.reported
        met = abs(ratio - 1) <= 0.25 and p.fits
        ok &= met
        print(f"{name:<14} {r.chips:>6} {r.metric:<16} {r.reported:>9.3g} {got:>9.3g} {ratio:>6.2f} "
              f"{'yes' if p.fits else 'NO':>4}  {'MET' if met else 'MISSED'}")
    return ok


def compare_rows():
    """The planner's best mesh for each published run, against the paper's (slow: minutes)."""
    from minidist.plan.search import compare_published

    print("\nthe planner's best mesh vs the published one (top 5 = agrees):")
    for name, r in RUNS.items():
        out = compare_published(r, top=5)
        print(f"{name}: best {out['best'].cand.label()} -- {out['explanation']}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strict", action="store_true", help="exit nonzero if any row misses its target")
    ap.add_argument("--calibrate", nargs="?", const="once", choices=("once", "each"),
                    help="re-measure this machine first (once), or before every row (each: ~20 s a row, so "
                         "calibration and measurement see the same load)")
    ap.add_argument("--compare", action="store_true", help="also search each published run's best (slow)")
    ap.add_argument("--mpi", action="store_true", help="run each mesh as mpirun -n N processes, not threads")
    ap.add_argument("--measure", type=int, nargs=4, metavar=("DP", "TP", "PP", "M"), help=argparse.SUPPRESS)
    clock_flags(ap)
    args = ap.parse_args()
    use_clock(args, wall_only="it checks the planner against this machine as calibrated (the planner "
                              "against the virtual clock: python -m minidist.lessons.planning --clock "
                              "virtual --link nvlink --device h100)")
    if args.measure:  # one mesh, under mpirun (measure_mpi): rank 0 prints its median step
        step = measure_here(CFG, BATCH, *args.measure)
        if int(os.environ.get("PMI_RANK", "0")) == 0:
            print(f"step {step!r}", flush=True)
        return
    print_machine()
    ok = here_rows(args)
    ok &= published_rows()
    if args.compare:
        compare_rows()
    if args.strict and not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
