"""What every benchmark prints around its numbers: the machine it ran on, and MET / MISSED per target.

    from bench_env import print_machine, Targets
    print_machine()                      # CPU model, the BLAS NumPy calls (threadpoolctl), load average
    targets = Targets()
    targets.check("train step / PyTorch", ratio, "<=", 1.0)
    return targets.exit_code(strict)     # nonzero on a miss only under --strict

A ratio measured while other programs run is not the machine's: the load average is printed before
and after, so a reader can tell a quiet run from a busy one.
"""

from __future__ import annotations

import os

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
