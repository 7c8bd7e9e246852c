"""`python -m minidist.calibrate`: measure this machine once for the planner's `--hardware here`.

In one thread's CPU seconds (what the work costs on a core of its own, whatever else runs): matmul
FLOP/s, memory bandwidth, the cost of one autograd op outside its arithmetic, the rates minidist's
own kernels reach (`kernels`), the Python of a block, of the embedding + head and of a step per
parameter tensor, and `cold` (a whole step over the sum of its parts). In wall time, because sharing
is what they measure: the cores' worth processes and thread ranks get (`threads`), the threads
transport's all-reduce alpha and beta, and (`processes`, the mpirun probe) what 2, 4 and 8 MPI
processes get at once. The load average is recorded beside them. Writes
~/.cache/minidist/calibration.json (`minidist.plan.hardware.CALIBRATION_PATH`);
`minidist.plan.hardware.here()` reads it back. What each constant is for, and how far to trust it
on a shared machine: chapter 11 (lessons/11-planning.md, "Timing here").

One idea to a file: `minidist.plan.clock` (the clocks and the timing loop), `calibrate_kernels`
(kernels and Python, CPU seconds), `calibrate_cores` (cores' worth and the threads link, wall time),
`calibrate_mpi` (the mpirun probe); this file runs them all and writes the file.
"""


from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

from minidist.plan.calibrate_cores import (  # noqa: F401 - re-exported: calibrate_mpi and tests use them
    _work,
    allreduce_alpha_beta,
    effective_cores,
    fit_link,
    thread_counts,
)
from minidist.plan.calibrate_kernels import (  # noqa: F401 - re-exported
    WHOLE_GPT,
    WHOLE_ROWS,
    cold_factor,
    kernels,
    matmul_flops,
    mem_bandwidth,
    op_overhead,
    python_costs,
    step_python,
    step_seconds,
)
from minidist.plan.clock import _median_time, cpu  # noqa: F401 - re-exported
from minidist.plan.hardware import CALIBRATION_PATH


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def processes() -> list:
    """The mpirun probe (`minidist.plan.calibrate_mpi`): per process count, the cores' worth and all-reduce
    links n MPI processes get. [] without mpiexec or if the probe fails (said on stderr): the planner
    then prices MPI ranks with the free cores and the threads transport's link."""
    from minidist.plan.calibrate_mpi import probe_processes  # defers mpi4py and the probe's GPT

    try:
        return probe_processes()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        print(f"calibrate: the mpirun probe failed ({e}); MPI step times will use the free cores",
              file=sys.stderr)
        return []


def calibrate(path: str = CALIBRATION_PATH) -> dict:
    try:
        from threadpoolctl import threadpool_limits
        limit = threadpool_limits(1)
    except ImportError:
        limit = None
    alpha, beta = allreduce_alpha_beta()
    cores = len(os.sched_getaffinity(0))
    threads = thread_counts(cores)
    c = {"cpu": cpu_name(), "cores": cores, "cores_free": effective_cores(cores),
         "flops": matmul_flops(),
         "mem_bandwidth": mem_bandwidth(), "op_overhead": op_overhead(), "alpha": alpha, "beta": beta,
         "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "time": time.time(),
         "kernels": kernels(), "load": os.getloadavg()[0]}
    # one rank's share of a core, measured at the start (thread_counts), the middle and the end of
    # the ~20 s: the median of the three, so a burst of someone else's work during one of them does
    # not price every lone rank (one calibration caught 0.25 of a core and predicted dp1 4x too slow)
    ones = [threads[0]["cores"], effective_cores(1, minidist_ops=True, batch=16)]
    c["processes"] = processes()
    ones.append(effective_cores(1, minidist_ops=True, batch=16))
    threads[0]["cores"] = float(np.median(ones))
    c.update(threads=threads, cores_threads=threads[1]["cores"], cores_threads_crowded=threads[-1]["cores"],
             load=(c["load"] + os.getloadavg()[0]) / 2)  # the load average at the middle and the end
    if limit is not None:
        limit.unregister() if hasattr(limit, "unregister") else None
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:  # written whole, then renamed: a reader never sees half a file
        json.dump(c, f, indent=1)
    os.replace(tmp, path)
    return c


def main() -> None:
    c = calibrate()
    threads = ", ".join(f"{e['cores']:.1f} to {e['ranks']}" for e in c["threads"])
    print(f"{c['cpu']}, {c['cores']} cores ({c['cores_free']:.1f} free to processes; minidist's thread "
          f"ranks get {threads}; load average {c['load']:.1f}):")
    print(f"  matmul {c['flops'] / 1e9:.1f} GFLOP/s (one thread), memory "
          f"{c['mem_bandwidth'] / 1e9:.1f} GB/s, op overhead {c['op_overhead'] * 1e6:.1f} us, all-reduce "
          f"alpha {c['alpha'] * 1e6:.1f} us, beta {1 / c['beta'] / 1e9:.2f} GB/s")
    for e in c["processes"]:
        link = ", ".join(f"{a} alpha {by['fg'][0] * 1e6:.0f} us ({by['bg'][0] * 1e6:.0f} us on DDP's thread)"
                         for a, by in e["links"].items())
        print(f"  {e['ranks']} MPI processes: {e['cores']:.1f} cores' worth, +{e.get('python', 0):.2f} s "
              f"per s of Python; all-reduce {link}")
    print(f"wrote {CALIBRATION_PATH}")


if __name__ == "__main__":
    main()
