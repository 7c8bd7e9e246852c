"""Lesson 2: all-reduce five ways -- naive, tree, ring, two-shot, halving-doubling -- and MPI's own
(under mpirun also through the node's shared memory, what ``auto`` runs there).

    python -m minidist.lessons.allreduce --ranks 8          # ranks as threads
    mpirun -n 8 python -m minidist.lessons.allreduce        # ranks as MPI processes

    python -m minidist.lessons.allreduce --ranks 64 --clock virtual --link ethernet   # an emulated cluster

On the virtual clock (``--clock virtual``, ``--link``; compute priced on ``--device``, default h100)
first the alpha-beta model of the link against the real algorithms' times: tree, ring and
halving-doubling at sizes around the model's crossover, where they cross (``allreduce_model``), and
the ring on 2, 4, ... p ranks beside 2(p-1)·alpha + 2(p-1)/p·N/beta. On the wall clock first the
alpha-beta model fitted on this machine: four algorithms at three sizes, alpha and beta by least
squares, predicted vs measured, and where ``algorithm="auto"`` switches. Then for each algorithm:
the result checked against the serial twin (a NumPy sum of every rank's array), the bytes each rank
sent (from the ledger) beside the formula, and the time (the virtual clock's, the wall clock's
beside it). Then the
ring's schedule: which chunk each rank passes to its right neighbour at each step.
``--plot FILE.png`` draws the same numbers: bytes each rank sent beside the formula, and the time.
"""

from __future__ import annotations

import time

import numpy as np

from minidist.comm import (
    all_reduce,
    halving_doubling_all_reduce,
    measure,
    mpi_all_reduce,
    naive_all_reduce,
    ring_all_reduce,
    shm_all_reduce,
    split_sizes,
    tree_all_reduce,
    two_shot_all_reduce,
)
from minidist.comm.cost import agreed_crowded, all_reduce_counts, choose_algorithm, shm_two_shot
from minidist.comm.ring import ring_chunks
from minidist.comm.transports.shm import window_bytes
from minidist.lessons.allreduce_model import crossover_section, ring_scaling, virtual_seconds
from minidist.lessons.cli import (
    check_fits,
    default_device,
    finish,
    launch,
    lesson_parser,
    nonnegative_int,
    positive_int,
    reject_early,
    rprint,
    world_size,
)
from minidist.lessons.progress import progress
from minidist.plan import estimates

# what one element costs a rank: x and the result (float32), the twin's float64 sum and the float32 /
# float64 input it adds (rank_main), and one float32 chunk buffer of the algorithm
BYTES_PER_ELEMENT = 4 + 4 + 8 + 4 + 8 + 4


def rank_input(rank: int, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed + rank).standard_normal(n).astype(np.float32)


def formula(name: str, p: int, n: int, itemsize: int) -> tuple[str, float]:
    """The textbook bytes sent by the busiest rank, as (text, value), for n elements per rank.

    Ring, exactly: rank r sends 2N - |c_r| - |c_r+1| with c = np.array_split chunks (= 2(p-1)/p N
    when p divides n)."""
    N, log2p = n * itemsize, (p - 1).bit_length()
    c = [s * itemsize for s in split_sizes(n, p)]
    ring = max(2 * N - c[r] - c[(r + 1) % p] for r in range(p)) if p > 1 else 0
    shm_two = shm_two_shot(min(N, window_bytes(p)), p)  # each piece of at most the window's size
    return {
        "naive": ("(p-1)N at the root", (p - 1) * N),
        "tree": ("ceil(log2 p)N at the root", log2p * N),
        "ring": ("2(p-1)/p N, every rank", ring),
        "two-shot": ("2(p-1)/p N, in 2 rounds", max(N + (p - 2) * c[r] for r in range(p)) if p > 1 else 0),
        "halving": ("2(p-1)/p N (p = 2^k, p | n)", 2 * (p - 1) * N / p if p & (p - 1) == 0 and n % p == 0
                    else float("nan")),
        "shm": (("N + N/p written (two-shot)" if shm_two else "N written (one-shot)"),
                N + max(c) if shm_two and p > 1 else N if p > 1 else 0),
        "mpi": ("MPI's own (not in ledger)", float("nan")),
    }[name]


def timed(comm, fn, x, repeats: int) -> float:
    """Median seconds of ``fn(comm, x)`` (ranks start together: a barrier before each run)."""
    times = []
    for _ in range(repeats):
        comm.barrier()
        t = time.perf_counter()
        fn(comm, x)
        times.append(time.perf_counter() - t)
    return float(np.median(times))


SCALING_BYTES = 1 << 20  # the ring's N as p grows (whole float32 chunks for p up to 64)
MODEL_ALGOS = ("ring", "two_shot", "halving_doubling", "recursive_doubling")
MODEL_SIZES = (4 << 10, 64 << 10, 1 << 20)  # bytes: where latency rules, the middle, where bandwidth does


def alpha_beta_section(comm, repeats: int) -> list[str]:
    """Fit t = rounds·alpha + bytes_sent·beta on this machine (the slowest rank's median of each
    algorithm at each size); lines comparing prediction and measurement, and where auto switches."""
    p, runs = comm.size, []
    for nbytes in progress(MODEL_SIZES, desc="alpha-beta fit", unit="size", rank=comm.rank):
        x = np.ones(nbytes // 4, np.float32)
        for a in MODEL_ALGOS:
            def run(c, v, a=a):
                return all_reduce(c, v, algorithm=a)
            run(comm, x)  # warm up: the first call builds the private communicators
            sec = max(comm.allgather_obj(timed(comm, run, x, repeats)))
            rounds, _, sent, _ = all_reduce_counts(a, nbytes, p)
            runs.append((a, nbytes, rounds, sent, sec))
    alpha, beta = estimates.fit_alpha_beta(*zip(*[(r, s, t) for _, _, r, s, t in runs]), relative=True)
    lines = [f"the alpha-beta model, fitted here on {p} ranks ({comm.transport}): t = rounds·alpha + "
             f"bytes_sent·beta", f"  alpha = {alpha * 1e6:.1f} us per round, beta = {beta * 1e9:.3f} ns per "
             f"byte ({1 / beta / 1e9:.2f} GB/s); least relative squares over {len(runs)} timed runs", "",
             f"  {'algorithm':<19}" + "".join(f"{_size(n) + ' pred/meas ms':>26}" for n in MODEL_SIZES)]
    for a in MODEL_ALGOS:
        cells = [f"{(r * alpha + s * beta) * 1e3:>12.3f} / {t * 1e3:<8.3f}" for name, _, r, s, t in runs
                 if name == a]
        lines.append(f"  {a:<19}" + "".join(f"{c:>26}" for c in cells))
    fitted = [min(MODEL_ALGOS, key=lambda a, n=n: _predict(a, n, p, alpha, beta)) for n in MODEL_SIZES]
    measured = [min((t, a) for a, n2, _, _, t in runs if n2 == n)[1] for n in MODEL_SIZES]
    crowd = agreed_crowded(comm)

    def by_size(choice):
        return ", ".join(f"{_size(n)} {a}" for n, a in zip(MODEL_SIZES, choice))
    lines += ["", f"  fastest measured: {by_size(measured)}",
              f"  fastest predicted by the fit: {by_size(fitted)}",
              f"  auto (cost.py's constants, {'ranks outnumber cores' if crowd else 'a core per rank'}): "
              + auto_switches(p, crowd)]
    return lines


def _predict(algorithm: str, nbytes: int, p: int, alpha: float, beta: float) -> float:
    rounds, _, sent, _ = all_reduce_counts(algorithm, nbytes, p)
    return rounds * alpha + sent * beta


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


def auto_switches(p: int, is_crowded: bool) -> str:
    """Where ``choose_algorithm`` changes its choice, 1 KB .. 64 MB in powers of two."""
    out, last = [], None
    for k in range(10, 27):
        a = choose_algorithm(1 << k, p, is_crowded)
        if a != last:
            out.append(f"{a} from {_size(1 << k)}")
            last = a
    return "; ".join(out)


def ring_timeline(p: int) -> str:
    """The ring schedule as text: at each step every rank sends one chunk to its right neighbour."""
    rows = [f"{'step':>4}  {'phase':<15}" + "".join(f"{'rank ' + str(r):>8}" for r in range(p))]
    for phase in ("reduce-scatter", "all-gather"):
        for s in range(p - 1):
            sends = [f"c{ring_chunks(r, p, s, phase)[0]}" for r in range(p)]
            rows.append(f"{len(rows):>4}  {phase:<15}" + "".join(f"{c:>8}" for c in sends))
    return "\n".join(rows)


def plot(path: str, rows: list[tuple], p: int, nbytes: int, clock: str = "median") -> None:
    """Two panels, one group per algorithm: the bytes each rank sent (bars) beside the formula for
    the busiest rank (a black tick), and the time (``clock``: "median" wall time, or "virtual").
    ``rows``: (name, sent per rank, formula, sec)."""
    import matplotlib

    matplotlib.use("Agg")  # a file, no window
    import matplotlib.pyplot as plt

    fig, (ax_b, ax_t) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    width = 0.8 / p
    for i, (_, sent, f, _) in enumerate(rows):
        xs = [i - 0.4 + width * (r + 0.5) for r in range(p)]
        ax_b.bar(xs, [b / 1e6 for b in sent], width,
                 color=[plt.cm.viridis(r / max(p - 1, 1)) for r in range(p)])
        if not np.isnan(f):
            ax_b.hlines(f / 1e6, i - 0.45, i + 0.45, colors="black",
                        label="formula (busiest rank)" if i == 0 else None)
    ax_b.set_xticks(range(len(rows)), [r[0] for r in rows])
    ax_b.set_ylabel("MB sent (1e6 bytes; a bar per rank, 0..p-1)")
    ax_b.set_title(f"bytes sent per rank, ledger vs formula\n(p = {p} ranks, N = {nbytes:,} bytes each)",
                   fontsize=10)
    ax_b.legend(loc="lower right")
    ax_t.bar(range(len(rows)), [r[3] * 1e3 for r in rows], color="tab:orange")
    ax_t.set_xticks(range(len(rows)), [r[0] for r in rows], rotation=30)
    ax_t.set_ylabel(f"{clock} time (ms)")
    ax_t.set_title(f"{clock} time per all-reduce\n(N = {nbytes:,} bytes, p = {p})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def rank_main(comm, args):
    p, n = comm.size, args.elements
    x = comm.backend.from_host(rank_input(comm.rank, n, args.seed))  # on this rank's device
    want = sum(rank_input(r, n, args.seed).astype(np.float64) for r in range(p))  # the serial twin
    N = x.nbytes
    algos = {"naive": naive_all_reduce, "tree": tree_all_reduce, "ring": ring_all_reduce,
             "two-shot": two_shot_all_reduce, "halving": halving_doubling_all_reduce}
    virtual = comm.clock is not None
    if comm.transport == "mpi" and not virtual:  # one node: through shared memory (auto's choice), MPI's
        algos |= {"shm": shm_all_reduce, "mpi": mpi_all_reduce}  # own (the virtual clock can't see them)
    passed = True
    if p > 1 and virtual:  # the headline: the link's alpha-beta model against the algorithms' own times
        lines, passed = crossover_section(comm)
        rprint(comm, "\n".join(lines) + "\n")
        lines, ok = ring_scaling(comm, SCALING_BYTES)
        passed &= ok
        rprint(comm, "\n".join(lines) + "\n")
    elif p > 1 and not args.no_model:
        rprint(comm, "\n".join(alpha_beta_section(comm, args.repeats)) + "\n")
    rprint(comm, f"all-reduce of {n} float32 ({N / 2**20:.2f} MiB) per rank over {p} ranks "
                 f"({comm.transport} transport, {comm.backend.name} arrays)\n")
    rprint(comm, f"{'algorithm':<8} {'max|diff|':>10} {'check':>6} {'sent/rank (max)':>16} "
                 f"{'formula':>12}  {'':<28} {'steps':>5} {'clock ms' if virtual else 'time ms':>8} "
                 f"{'busbw GB/s':>10}" + (f" {'wall ms':>8}" if virtual else ""))
    rows = []  # (name, bytes sent by each rank, formula, seconds): what --plot draws
    for name, fn in algos.items():
        with measure(comm) as m:
            y = fn(comm, x)
        diff = float(np.max(np.abs(comm.backend.to_host(y) - want))) if n else 0.0
        ok = diff <= 1e-4 * max(1.0, float(np.max(np.abs(want))) if n else 1.0) * p
        sent = comm.allgather_obj(m.bytes_sent)
        wall = sec = timed(comm, fn, x, args.repeats)
        if virtual:  # the emulated cluster's time is the headline; this machine's beside it
            sec = virtual_seconds(comm, lambda fn=fn: fn(comm, x))
        text, f = formula(name, p, n, x.itemsize)
        busbw = 2 * (p - 1) / p * N / sec / 1e9 if p > 1 else float("nan")
        rows.append((name, sent, f, sec))
        passed &= ok
        rprint(comm, f"{name:<8} {diff:>10.2e} {'PASS' if ok else 'FAIL':>6} {max(sent):>16,} "
                     f"{'-' if np.isnan(f) else f'{f:,.0f}':>12}  {text:<28} {m.steps:>5} "
                     f"{sec * 1e3:>8.2f} {busbw:>10.2f}" + (f" {wall * 1e3:>8.2f}" if virtual else ""))
    if p > 1:
        rprint(comm, f"\nring timeline: x is split into chunks c0..c{p - 1}; at each step every rank sends "
                     "the chunk shown\nto rank+1 and receives one from rank-1 (adding it in reduce-scatter)")
        rprint(comm, ring_timeline(p))
        rprint(comm, "after reduce-scatter rank r owns the full sum of chunk r; all-gather passes it round.")
    if args.plot and comm.rank == 0:
        plot(args.plot, rows, p, N, "virtual" if virtual else "median")
        print(f"wrote {args.plot}: bytes per rank vs formula, and time, per algorithm", flush=True)
    return finish(comm, passed)


def main(argv=None):
    parser = lesson_parser(__doc__, ranks=4)
    parser.add_argument("--elements", type=nonnegative_int, default=1 << 18, help="float32 elements per rank")
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--no-model", action="store_true", help="skip fitting the alpha-beta model first")
    args = parser.parse_args(argv)
    default_device(args, "h100")  # compute priced on a device: the sums ride in the transfer (alpha-beta)
    p = world_size(args)
    # every rank (on one machine) holds x and its result in float32 and the float64 twin it builds
    reject_early(parser, lambda: check_fits("--elements", args.elements, p * BYTES_PER_ELEMENT,
                                            f"{BYTES_PER_ELEMENT} bytes per element on each of {p} ranks"))
    return launch(rank_main, args)


if __name__ == "__main__":
    from minidist.lessons.cli import run_lesson

    run_lesson(main)
