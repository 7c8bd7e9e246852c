"""What every benchmark prints around its numbers: the machine it ran on, and MET / MISSED per target.

    from bench_env import print_machine, Targets
    print_machine()                      # CPU model, the BLAS NumPy calls (threadpoolctl), load average
    targets = Targets()
    targets.check("train step / PyTorch", ratio, "<=", 1.0)
    return targets.exit_code(strict)     # nonzero on a miss only under --strict

A ratio measured while other programs run is not the machine's: the load average is printed before
and after, so a reader can tell a quiet run from a busy one.

    clock_flags(ap)                      # --clock wall|virtual, --link, --device, as every lesson has
    print(use_clock(args))               # in effect for the ranks run() starts; says which clock times what
    use_clock(args, wall_only="it compares with PyTorch, which only the wall clock can time")  # refuses

Under ``--clock virtual`` minidist is timed on each rank's clock (``minidist.trace.clock.now()``: compute
in CPU time or ``--device``'s roofline, each message ``--link``'s alpha + bytes/beta): no load changes it.
"""

from __future__ import annotations

import argparse
import os
import sys

from minidist.plan.calibrate import cpu_name as cpu_model  # one reader of /proc/cpuinfo


def blas() -> str:
    """The BLAS library NumPy calls, its kernel (architecture) and thread count, from threadpoolctl."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "unknown (threadpoolctl is not installed)"
    libs = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    return "; ".join(f"{i.get('internal_api')} {i.get('version')} kernel {i.get('architecture')} "
                     f"threads {i.get('num_threads')}" for i in libs) or "none found"


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def print_machine() -> None:
    pinned = [k for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if k in os.environ]
    print(f"cpu: {cpu_model()} ({os.cpu_count()} logical cores)")
    print(f"blas: {blas()}" + (f"  [{', '.join(pinned)} set: unset both to benchmark]" if pinned else ""))
    print(f"load average (1, 5, 15 min): {load_average()}")


def clock_flags(ap: argparse.ArgumentParser) -> None:
    """``--clock``, ``--link`` (unless the benchmark has its own) and ``--device``, as a lesson's."""
    from minidist.lessons.cli import DEVICES, LINKS  # defers the lessons' command line to the parser

    ap.add_argument("--clock", choices=("wall", "virtual"), default="wall",
                    help="wall (the default): this machine's time; virtual: minidist timed as the emulated "
                         "cluster would run it")
    if "--link" not in ap._option_string_actions:
        ap.add_argument("--link", default=None, help=f"the link every message crosses: {', '.join(LINKS)}, "
                        "here, or alpha_us=...,gbps=... (virtual: charged; wall: emulated by waiting)")
    ap.add_argument("--device", default=None, help="--clock virtual: price compute on this device's roofline "
                    f"({', '.join(DEVICES)}, here) instead of CPU time")


def use_clock(args, wall_only: str = "") -> str:
    """Put ``--clock``/``--link``/``--device`` into effect for the ranks ``run`` starts (the environment
    a lesson's ``--clock`` sets: MINIDIST_CLOCK, MINIDIST_LINK, MINIDIST_DEVICE) and return the line
    saying which clock times minidist. ``wall_only``: why this benchmark needs the wall clock (its
    reference is PyTorch, MPI or a disk, which no rank's clock can time): ``--clock virtual`` then
    exits (status 2) with that reason before anything runs."""
    from minidist.comm.clock import default_link, parse_device
    from minidist.lessons import cli

    if args.clock == "virtual" and wall_only:
        print(f"--clock virtual: not for this benchmark, {wall_only}; run it on the wall clock (the default)",
              file=sys.stderr)
        raise SystemExit(2)
    try:
        cli.use_clock(args)
    except ValueError as e:  # a bad --link or --device names what would be right
        raise SystemExit(f"{e}") from None
    if args.clock != "virtual":
        return "clock: wall (every contender timed alike, on this machine as it is loaded now)"
    link, device = default_link(), parse_device(os.environ.get("MINIDIST_DEVICE"))
    compute = f"on {device}" if device else "in CPU time"
    return (f"clock: virtual -- minidist timed on each rank's clock: each message {link.alpha * 1e6:g} us "
            f"+ bytes / {link.bandwidth / 1e9:g} GB/s, compute {compute}")


class Targets:
    """Collects target checks; prints one MET / MISSED line per target as it is checked."""

    def __init__(self):
        self.missed: list[str] = []

    def check(self, name: str, value: float, op: str, target: float, unit: str = "") -> bool:
        met = value <= target if op == "<=" else value >= target
        print(f"  target {name}: {value:.3g}{unit} {op} {target:g}{unit}  {'MET' if met else 'MISSED'}")
        if not met:
            self.missed.append(name)
        return met

    def exit_code(self, strict: bool) -> int:
        print(f"load average at the end: {load_average()}")
        if self.missed:
            print(f"MISSED {len(self.missed)} target(s): {', '.join(self.missed)}"
                  + ("" if strict else " (exit 0: pass --strict to fail on a miss)"))
        return 1 if (strict and self.missed) else 0
