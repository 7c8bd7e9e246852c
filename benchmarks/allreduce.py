"""minidist's all-reduce (built on point-to-point) against MPI's own ``Allreduce``, in the same run.

    mpirun -n 2 python benchmarks/allreduce.py
    mpirun -n 8 python benchmarks/allreduce.py --algorithms auto,ring,halving_doubling --max-bytes 16M

float32, 4 KB .. 64 MB. Prints, from rank 0, per size: MPI's time (us) and bus bandwidth (algbw x
2(p-1)/p, the bytes each rank's links carry per second: comparable across p), then for each of
our algorithms its time, bus bandwidth and the ratio ours / MPI (higher is better; targets: >= 1.0 from
1 MB, >= 0.5 at 4 KB). Every repeat starts together after a barrier and lasts as long as its
slowest rank; a round times each contender (MPI's and ours, interleaved) as the median of its
repeats; the table shows the median over ``--rounds`` rounds, so a burst of load from other jobs
hits every contender alike. The machine's load average is printed: on a shared machine, note it.
"""

from __future__ import annotations

import argparse
import os
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
    p, algos = comm.size, args.algorithms.split(",")
    if comm.transport != "mpi":
        raise SystemExit("run me under mpirun: mpirun -n 4 python benchmarks/allreduce.py")
    if comm.rank == 0:
        print(f"all-reduce float32 sum, {p} ranks on {os.cpu_count()} cores, load average "
              f"{os.getloadavg()[0]:.1f}; {args.rounds} rounds; MPI: "
              f"{MPI.Get_library_version().splitlines()[0].strip()}   (busbw in GB/s)")
        print(f"{'bytes':>10} {'MPI us':>9} {'MPI bw':>7}"
              + "".join(f" {a[:18] + ' us':>21} {'bw':>6} {'ratio':>5}" for a in algos))
    nbytes, rows = args.min_bytes, []
    while nbytes <= args.max_bytes:
        x = np.random.default_rng(comm.rank).standard_normal(nbytes // 4).astype(np.float32)
        buf = x.copy()
        repeats = max(3, min(args.repeats, int(args.budget / max(nbytes / 2e8, 1e-5))))
        fns = {"mpi": lambda x=x, buf=buf: comm.mpi.Allreduce(x, buf, op=MPI.SUM)}
        fns["mpi"]()
        for a in algos:
            fns[a] = lambda x=x, a=a: all_reduce(comm, x, algorithm=a)
            assert np.allclose(fns[a](), buf, rtol=1e-4, atol=1e-4 * p), f"{a}: results differ"  # warm up
        times = {k: [] for k in fns}
        for _ in range(args.rounds):
            for k, fn in fns.items():
                times[k].append(median_time(comm, fn, repeats))
        t = {k: float(np.median(v)) for k, v in times.items()}
        bus = 2 * (p - 1) / p * nbytes / 1e9
        rows.append((nbytes, t))
        if comm.rank == 0:
            cols = (f" {t[a] * 1e6:>21.1f} {bus / t[a]:>6.2f} {t['mpi'] / t[a]:>5.2f}" for a in algos)
            print(f"{nbytes:>10,} {t['mpi'] * 1e6:>9.1f} {bus / t['mpi']:>7.2f}" + "".join(cols), flush=True)
        nbytes *= 4
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--min-bytes", type=parse_bytes, default=4096)
    ap.add_argument("--max-bytes", type=parse_bytes, default=64 << 20)
    ap.add_argument("--algorithms", default="auto", help="comma-separated: auto, ring, halving_doubling, ...")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the table shows their median")
    ap.add_argument("--repeats", type=int, default=50, help="at most this many timed runs per size and round")
    ap.add_argument("--budget", type=float, default=0.3, help="rough seconds per size, contender and round")
    args = ap.parse_args()
    run(bench, args=args)


if __name__ == "__main__":
    main()
