"""The two clocks calibration times with, and its one timing loop (`_median_time`).

`cpu` (a thread's CPU seconds) prices what work costs on a core of its own; wall time
(`time.perf_counter`) measures sharing: how much of the cores the ranks really get.
"""

from __future__ import annotations

import time

import numpy as np


def _median_time(fn, repeats: int = 7, min_time: float = 0.02, clock=time.perf_counter) -> float:
    """Median seconds per call; each sample repeats `fn` for at least `min_time`, so a sample is a
    sustained rate (what a training step sees), not one lucky burst on a shared machine.
    `min_time=0` for collectives: every rank must call them the same number of times. `clock`:
    wall time, or `cpu` for the work of one thread alone (see `cpu`)."""
    fn()
    ts = []
    for _ in range(repeats):
        n, t0 = 0, clock()
        while True:
            fn()
            n += 1
            dt = clock() - t0
            if dt >= min_time:
                break
        ts.append(dt / n)
    return float(np.median(ts))


# What one thread's work costs on a core of its own is timed in that thread's CPU seconds, not wall
# seconds: another program taking the core for a while stretches the wall time of whatever runs
# (at load 7.7 on 2 vCPUs a single rank's wall-time calibration was 17-35% off, its CPU time 9-13%),
# but not the CPU seconds the work needs. How much of the cores the ranks get is measured apart, in
# wall time (`effective_cores`, the mpirun probe): that is where the load shows.
cpu = time.thread_time
