"""`python -m minidist.calibrate`: measure this machine once for the planner's `--hardware here`.

Measures, with one BLAS thread (as every minidist rank runs): float32 matmul FLOP/s, memory
bandwidth (a large copy), the cost of one autograd op outside its arithmetic (forward + backward
of a tiny add: Python and dispatch), and the threads transport's ring all-reduce alpha (seconds
per step) and beta (seconds per byte) by a least-squares fit over message sizes. Writes them to
~/.cache/minidist/calibration.json (`minidist.hardware.CALIBRATION_PATH`); `minidist.hardware.here()`
reads them back.
"""

from __future__ import annotations

import json
import os
import platform
import time

import numpy as np

from minidist.hardware import CALIBRATION_PATH


def _median_time(fn, repeats: int = 7) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def matmul_flops(n: int = 256) -> float:
    a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    return 2 * n**3 / _median_time(lambda: a @ a)


def mem_bandwidth(nbytes: int = 64 << 20) -> float:
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    return 2 * nbytes / _median_time(lambda: np.copyto(dst, src))  # read + write


def op_overhead(n: int = 200) -> float:
    """Seconds per op (forward + backward) of tiny tensors: everything but the arithmetic."""
    from minidist.tensor import Tensor

    def chain():
        x = Tensor(np.ones((2, 2), np.float32), requires_grad=True)
        y = x
        for _ in range(n):
            y = y + x
        y.sum().backward()
    return _median_time(chain) / (n + 1)


def allreduce_alpha_beta(ranks: int = 2) -> tuple[float, float]:
    from minidist.comm import all_reduce, run

    sizes = [1 << 10, 1 << 16, 1 << 20, 1 << 22]

    def body(comm):
        out = []
        for nbytes in sizes:
            x = np.ones(nbytes // 4, np.float32)
            out.append(_median_time(lambda x=x: all_reduce(comm, x, algorithm="ring"), 5))
        return out
    times = np.array(run(body, ranks=ranks)).max(axis=0)
    steps = 2 * (ranks - 1)
    sent = np.array([2 * (ranks - 1) / ranks * s for s in sizes])
    a = np.stack([np.full(len(sizes), steps), sent], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(a, times, rcond=None)
    return max(float(alpha), 1e-7), max(float(beta), 1e-12)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def calibrate(path: str = CALIBRATION_PATH) -> dict:
    try:
        from threadpoolctl import threadpool_limits
        limit = threadpool_limits(1)
    except ImportError:
        limit = None
    alpha, beta = allreduce_alpha_beta()
    c = {"cpu": cpu_name(), "cores": len(os.sched_getaffinity(0)), "flops": matmul_flops(),
         "mem_bandwidth": mem_bandwidth(), "op_overhead": op_overhead(), "alpha": alpha, "beta": beta,
         "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "time": time.time()}
    if limit is not None:
        limit.unregister() if hasattr(limit, "unregister") else None
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(c, f, indent=1)
    return c


def main() -> None:
    c = calibrate()
    print(f"{c['cpu']}, {c['cores']} cores: matmul {c['flops'] / 1e9:.1f} GFLOP/s (one thread), memory "
          f"{c['mem_bandwidth'] / 1e9:.1f} GB/s, op overhead {c['op_overhead'] * 1e6:.1f} us, all-reduce "
          f"alpha {c['alpha'] * 1e6:.1f} us, beta {1 / c['beta'] / 1e9:.2f} GB/s")
    print(f"wrote {CALIBRATION_PATH}")


if __name__ == "__main__":
    main()
