"""minidist's all-reduce (built on point-to-point) against MPI's own ``Allreduce``, in the same run.

    mpirun -n 2 python benchmarks/allreduce.py
    mpirun -n 8 python benchmarks/allreduce.py --algorithm ring --max-bytes 16M

float32, 4 KB .. 64 MB. Prints, from rank 0, per size: time of each, bus bandwidth
(algbw x 2(p-1)/p, the bytes each rank's links carry per second: comparable across p) and the ratio
ours / MPI (higher is better; targets: >= 1.0 from 1 MB, >= 0.5 at 4 KB). Each measurement is the
median over repeats, every repeat started together after a barrier, ours and MPI's interleaved.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from minidist.comm import all_reduce, run


def parse_bytes(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * units[s[-1].upper()]) if s[-1].upper() in units else int(s)


def median_time(comm, fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        comm.mpi.Barrier()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    times = np.array(times)
    comm.mpi.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)  # a repeat lasts as long as its slowest rank
    return float(np.median(times))


def bench(comm, args):
    p = comm.size
    if comm.transport != "mpi":
        raise SystemExit("run me under mpirun: mpirun -n 4 python benchmarks/allreduce.py")
    if comm.rank == 0:
        print(f"all-reduce float32 sum, {p} ranks, minidist algorithm={args.algorithm} vs MPI Allreduce "
              f"({MPI.Get_library_version().splitlines()[0].strip()})")
        print(f"{'bytes':>10} {'ours ms':>9} {'MPI ms':>9} {'ours busbw':>11} {'MPI busbw':>10} "
              f"{'ratio':>6}   (busbw in GB/s)")
    nbytes, rows = args.min_bytes, []
    while nbytes <= args.max_bytes:
        n = nbytes // 4
        x = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
        buf = x.copy()
        repeats = max(3, min(args.repeats, int(args.budget / max(nbytes / 2e8, 1e-5))))
        ours = all_reduce(comm, x, algorithm=args.algorithm)  # warm up, and check
        comm.mpi.Allreduce(x, buf, op=MPI.SUM)
        assert np.allclose(ours, buf, rtol=1e-4, atol=1e-4 * p), "results differ"
        t_ours = median_time(comm, lambda x=x: all_reduce(comm, x, algorithm=args.algorithm), repeats)
        t_mpi = median_time(comm, lambda x=x, buf=buf: comm.mpi.Allreduce(x, buf, op=MPI.SUM), repeats)
        bus = 2 * (p - 1) / p * nbytes / 1e9
        rows.append((nbytes, t_ours, t_mpi))
        if comm.rank == 0:
            print(f"{nbytes:>10,} {t_ours * 1e3:>9.3f} {t_mpi * 1e3:>9.3f} {bus / t_ours:>11.3f} "
                  f"{bus / t_mpi:>10.3f} {t_mpi / t_ours:>6.2f}", flush=True)
        nbytes *= 4
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--min-bytes", type=parse_bytes, default=4096)
    ap.add_argument("--max-bytes", type=parse_bytes, default=64 << 20)
    ap.add_argument("--algorithm", default="auto")
    ap.add_argument("--repeats", type=int, default=50, help="at most this many timed runs per size")
    ap.add_argument("--budget", type=float, default=0.5, help="rough seconds per size")
    args = ap.parse_args()
    run(bench, args=args)


if __name__ == "__main__":
    main()
