"""Compression on an emulated slow link: the issue's targets, measured.

    python benchmarks/compression.py [--ranks 4] [--steps 40] [--link alpha_us=50,gbps=1] [--mpi] [--strict]

Trains the lesson's GPT (minidist/lessons/compression.py: same data, same steps) dense, with PowerSGD
r = 4 (and r = 2, 8), and with DiLoCo H = 20, every message crossing the emulated link, and checks:

* PowerSGD r = 4: step time >= 3x faster than dense, final held-out loss within 3% of dense;
* DiLoCo H = 20: >= 15x fewer bytes than dense, final loss within 5%;
* every method: bytes sent == its formula, replicas identical.

Prints the CPU, the load average (other processes' load slows compute, which shrinks every speed-up),
MET/MISSED per target, and (threads) dense's step without the link: compute is not compressed, so
dense-with-link / dense-without bounds every method's speed-up. Exits nonzero on a miss only with
--strict. ``--mpi`` runs the ranks as ``mpirun -n RANKS`` processes (no GIL between ranks), not threads.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from bench_env import clock_flags, use_clock

from minidist.comm import run, under_mpi
from minidist.comm.transports.link import parse_link, set_link
from minidist.lessons import compression as lesson
from minidist.plan.calibrate import cpu_name

METHODS = ["dense", "PowerSGD r=2", "PowerSGD r=4", "PowerSGD r=8", "DiLoCo H=20"]


def rank_main(comm, args, methods=METHODS):
    batches, held_out = lesson.data(args, comm.size)
    results = {name: lesson.train(comm, args, name, batches, held_out) for name in methods}
    return results if comm.rank == 0 else None


def amdahl(dense, args):
    """Dense without the link (threads only: a second run): how much of dense's step the link is, and
    so the most any compression could gain here -- compute is not compressed."""
    set_link(None)
    bare = run(rank_main, ranks=args.ranks, args=args, methods=["dense"])[0]["dense"]
    link = parse_link(args.link)
    predicted = link.predict_all_reduce("ring", dense["n_params"] * 4, args.ranks)
    print(f"\ndense without the link: {1e3 * bare['step_s']:.1f} ms/step; with it "
          f"{1e3 * dense['step_s']:.1f} ms (link alpha-beta {1e3 * predicted:.1f} ms): no method's step "
          f"can beat {dense['step_s'] / bare['step_s']:.2f}x here, whatever it sends")


def report(results, args) -> bool:
    dense = results["dense"]
    print(f"{'method':<16}{'bytes/step':>12}{'ratio':>8}{'ms/step':>9}{'speed-up':>10}{'final loss':>12}"
          f"{'vs dense':>10}  bytes==formula  replicas")
    for name, r in results.items():
        steps = len(r["sent"])
        print(f"{name:<16}{r['total'] / steps:>12.0f}{lesson.ratio_cell(dense['total'], r['total'])}"
              f"{1e3 * r['step_s']:>9.1f}{dense['step_s'] / r['step_s']:>9.2f}x{r['final']:>12.4f}"
              f"{100 * (r['final'] / dense['final'] - 1):>+9.1f}%  {str(r['total'] == r['formula']):<15}"
              f"{'identical' if r['identical'] else 'DIFFER'}")
    ps, dl = results["PowerSGD r=4"], results["DiLoCo H=20"]
    targets = [
        ("PowerSGD r=4 step >= 3x faster than dense", dense["step_s"] / ps["step_s"], 3.0),
        ("PowerSGD r=4 final loss within 3% of dense", 1.03 - ps["final"] / dense["final"], 0.0),
        ("DiLoCo H=20 >= 15x fewer bytes than dense",  # none sent: fewer than --steps 20, no sync yet
         dense["total"] / dl["total"] if dl["total"] else float("nan"), 15.0),
        ("DiLoCo H=20 final loss within 5% of dense", 1.05 - dl["final"] / dense["final"], 0.0),
        ("every method's bytes == its formula",
         float(all(r["total"] == r["formula"] for r in results.values())), 1.0),
        ("every method's replicas identical", float(all(r["identical"] for r in results.values())), 1.0),
    ]
    ok = True
    print()
    for what, value, need in targets:
        met = value >= need
        ok &= met
        print(f"  {what:<46} measured {value:>7.3f} (need >= {need:g})  {'MET' if met else 'MISSED'}")
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--link", default="alpha_us=50,gbps=1")
    ap.add_argument("--mpi", action="store_true", help="run the ranks under mpirun instead of as threads")
    ap.add_argument("--strict", action="store_true", help="exit nonzero if a target is missed")
    clock_flags(ap)
    args = ap.parse_args()
    if args.mpi and not under_mpi():
        cmd = ["mpirun", "-n", str(args.ranks), sys.executable, __file__, "--steps", str(args.steps),
               "--link", args.link, "--clock", args.clock] + (["--strict"] if args.strict else []) \
            + (["--device", args.device] if args.device else [])
        sys.exit(subprocess.call(cmd))
    defaults = lesson.parser().parse_args([])  # the lesson's model, data and learning rates
    for k, v in vars(defaults).items():
        setattr(args, k, getattr(args, k, v))
    clock = use_clock(args)
    results = run(rank_main, ranks=args.ranks, args=args)[0]
    if results is None:  # an MPI rank other than 0
        return
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f}; "
          f"{'MPI processes' if under_mpi() else 'threads'}: {args.ranks if not under_mpi() else 'mpirun'} "
          f"ranks; link {args.link}; {args.steps} steps\n{clock}\n")
    ok = report(results, args)
    if not under_mpi():
        amdahl(results["dense"], args)
    if args.strict and not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
