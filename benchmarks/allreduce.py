"""minidist's all-reduce against MPI's own ``Allreduce``, in the same run; or, with ``--clock virtual``,
tree, ring and halving-doubling on an emulated cluster against the alpha-beta model of its link.

    mpirun -n 2 python benchmarks/allreduce.py
    mpirun -n 8 python benchmarks/allreduce.py --algorithms auto,ring,halving_doubling --max-bytes 16M
    python benchmarks/allreduce.py --clock virtual --ranks 16 --link ethernet     # threads or mpirun

``--clock virtual``: every message costs the link's alpha + bytes/beta (``--link``: nvlink, ici,
infiniband, ethernet, here, or alpha_us=..,gbps=..), compute is priced on an H100 (the sums ride in
the transfer), and each algorithm's time at each size is printed beside the model
(``minidist.lessons.allreduce_model``), with MET / MISSED: every time within 1% of the model, and
tree and ring crossing at the model's N* = alpha·beta·(p-1-L)/(L-(p-1)/p). MPI's own is left out
(the clock cannot see inside it). The wall clock (the default) is the comparison with MPI:

Under mpirun on one node ``auto`` is the shared-memory all-reduce (``shm``: ranks read each
other's buffers, no messages); ``ring``, ``two_shot``, ... are built on point-to-point messages.

float32, 4 KB .. 64 MB. Prints, from rank 0, per size: MPI's time (us) and bus bandwidth (algbw x
2(p-1)/p, the bytes each rank's links carry per second: comparable across p), then for each of
our algorithms its time, bus bandwidth and the ratio ours / MPI (higher is better). Then the per-call
overhead of a collective: a 1-element all-reduce alone on one rank (p = 1), and at this p minus
MPI's own time; and MET / MISSED per target (issue 14): >= 1.0x MPI at 4 KB and 64 KB for p = 2
(>= 0.8x for p > 2), >= 1.2x from 1 MB up, overhead < 5 us. Exits nonzero on a miss only with
--strict. Every repeat starts together after a barrier and lasts as long as its
slowest rank; a round times each contender (MPI's and ours, interleaved) as the median of its
repeats; the table shows the median over ``--rounds`` rounds, so a burst of load from other jobs
hits every contender alike. The machine's load average is printed: on a shared machine, note it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from mpi4py import MPI

from minidist.comm import all_reduce, run
from minidist.comm.runner import under_mpi

OVERHEAD_US = 5.0


def target_ratio(p: int, nbytes: int) -> float | None:
    """The lowest ratio ours / MPI the issue asks for at this size, or None (no target there)."""
    if nbytes >= 1 << 20:
        return 1.2
    if nbytes in (4096, 65536):
        return 1.0 if p == 2 else 0.8
    return None


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
        from bench_env import print_machine

        print_machine()
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
    return rows, per_call_overhead(comm, args.rounds)


def virtual_bench(comm, args):
    """Tree, ring, halving-doubling on the virtual clock at 10 sizes around the model's tree/ring
    crossover (from an eighth of it to 64 times it): [(bytes, {name: seconds})]."""
    from minidist.lessons.allreduce_model import ALGORITHMS, crossover, sizes_around, virtual_seconds

    link, p, rows = comm.clock.link, comm.size, []
    for nbytes in sizes_around(crossover("tree", "ring", p, link.alpha, link.bandwidth) or
                               64 * link.alpha * link.bandwidth, p, 10):
        x = np.ones(nbytes // 4, np.float32)
        rows.append((nbytes, {a: virtual_seconds(comm, lambda a=a, x=x: all_reduce(comm, x, algorithm=a))
                              for a in ALGORITHMS}))
    return rows


def virtual_report(p: int, rows, link, strict: bool) -> int:
    from bench_env import Targets, print_machine

    from minidist.lessons.allreduce_model import ALGORITHMS, NAMES, crossover, measured_crossover, model

    print_machine()
    print(f"all-reduce float32 sum on the virtual clock: {p} ranks, each message {link.alpha * 1e6:g} us + "
          f"bytes / {link.bandwidth / 1e9:g} GB/s; us per all-reduce, the model / the clock")
    print(f"{'bytes':>10}" + "".join(f"{NAMES[a]:>26}" for a in ALGORITHMS) + "  fastest")
    worst = 0.0
    for n, t in rows:
        cells = []
        for a in ALGORITHMS:
            want = model(a, p, n, link.alpha, link.bandwidth)
            worst = max(worst, abs(t[a] / want - 1))
            cells.append(f"{want * 1e6:>11.1f} / {t[a] * 1e6:<11.1f}")
        print(f"{n:>10,}" + "".join(f"{c:>26}" for c in cells) + f"  {NAMES[min(t, key=t.get)]}")
    targets = Targets()
    targets.check("largest |clock / model - 1|", worst, "<=", 0.01)
    want = crossover("tree", "ring", p, link.alpha, link.bandwidth)
    seen = measured_crossover([n for n, _ in rows], *([t[a] for _, t in rows] for a in ("tree", "ring")))
    if want is None:
        print("tree and ring: no crossover at p = 2 (the model's; the clock agrees: "
              f"{'yes' if seen is None else 'no'})")
    elif not rows[0][0] < want < rows[-1][0]:
        print(f"tree -> ring crossover N* = {want:,.0f} B lies outside the sizes measured: widen them")
    else:
        print(f"tree -> ring: the model's N* = {want:,.0f} B, the clock's {seen or 0:,.0f} B")
        targets.check("tree -> ring crossover, |clock / model - 1|", abs((seen or 0) / want - 1), "<=", 0.01)
    return targets.exit_code(strict)


def per_call_overhead(comm, rounds: int) -> tuple[float, float, float]:
    """Seconds per 1-element all-reduce: alone (rank 0 on a one-rank communicator while the others
    sleep: no message, only the call's own work), at this p with ``auto``, and MPI's ``Allreduce`` at
    this p (best round of many calls)."""
    solo = comm.split(color=comm.rank)
    x, buf = np.ones(1, np.float32), np.empty(1, np.float32)

    def per_call(fn, n=2000):
        best = float("inf")
        for _ in range(rounds + 2):
            comm.mpi.Barrier()
            best = min(best, _loop(fn, n))
        return comm.mpi.allreduce(best, op=MPI.MAX)

    alone = None
    if comm.rank == 0:  # alone on the machine: the other ranks wait in minidist's barrier, which sleeps
        all_reduce(solo, x)
        alone = min(_loop(lambda: all_reduce(solo, x), 2000) for _ in range(rounds + 2))
    comm.barrier()
    alone = comm.bcast_obj(alone, root=0)
    ours = per_call(lambda: all_reduce(comm, x))
    mpi = per_call(lambda: comm.mpi.Allreduce(x, buf, op=MPI.SUM))
    return alone, ours, mpi


def _loop(fn, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def report(p: int, rows, overhead, strict: bool) -> int:
    from bench_env import Targets

    targets = Targets()
    alone, ours, mpi = overhead
    print(f"per-call overhead of a 1-element all-reduce: alone (p = 1) {alone * 1e6:.1f} us; at p = {p} "
          f"{ours * 1e6:.1f} us vs MPI {mpi * 1e6:.1f} us: {(ours - mpi) * 1e6:.1f} us more")
    targets.check("per-call overhead at p = 1", alone * 1e6, "<=", OVERHEAD_US, " us")
    if p == 2:  # (the definition; with more ranks than cores it measures the scheduler)
        targets.check("per-call overhead at p = 2 minus MPI's", (ours - mpi) * 1e6, "<=", OVERHEAD_US, " us")
    for size, t in rows:
        low = target_ratio(p, size)
        for algo in (k for k in t if k != "mpi" and low is not None):
            targets.check(f"{algo} at {size:,} B, p = {p}, ours / MPI", t["mpi"] / t[algo], ">=", low)
    return targets.exit_code(strict)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clock", choices=("wall", "virtual"), default="wall",
                    help="virtual: tree, ring, halving-doubling on an emulated cluster, against the model")
    ap.add_argument("--link", default="ethernet", help="--clock virtual: the link every message crosses")
    ap.add_argument("--ranks", type=int, default=8, help="--clock virtual outside mpirun: thread ranks")
    ap.add_argument("--min-bytes", type=parse_bytes, default=4096)
    ap.add_argument("--max-bytes", type=parse_bytes, default=64 << 20)
    ap.add_argument("--algorithms", default="auto",
                    help="comma-separated: auto (shm on one node), shm, ring, two_shot, ...")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the table shows their median")
    ap.add_argument("--repeats", type=int, default=50, help="at most this many timed runs per size and round")
    ap.add_argument("--budget", type=float, default=0.3, help="rough seconds per size, contender and round")
    ap.add_argument("--strict", action="store_true", help="exit nonzero when a target is missed")
    args = ap.parse_args()
    if args.clock == "virtual":
        return virtual_main(args)
    (rows, overhead), = run(bench, args=args)
    code = 0
    if MPI.COMM_WORLD.Get_rank() == 0:
        code = report(MPI.COMM_WORLD.Get_size(), rows, overhead, args.strict)
    return MPI.COMM_WORLD.bcast(code, root=0)


def virtual_main(args) -> int:
    from minidist.comm.transports.link import parse_link, set_link
    from minidist.lessons.cli import device_spec, link_spec

    os.environ |= {"MINIDIST_CLOCK": "virtual", "MINIDIST_LINK": link_spec(args.link),
                   "MINIDIST_DEVICE": device_spec("h100")}
    link = parse_link(os.environ["MINIDIST_LINK"])
    set_link(link)
    rows = run(virtual_bench, ranks=args.ranks, args=args)[0]
    if under_mpi():
        if MPI.COMM_WORLD.Get_rank() != 0:
            return 0
        p = MPI.COMM_WORLD.Get_size()
    else:
        p = args.ranks
    return virtual_report(p, rows, link, args.strict)


if __name__ == "__main__":
    sys.exit(main())
