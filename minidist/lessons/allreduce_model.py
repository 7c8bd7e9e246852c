"""Lesson 2 on the virtual clock: the alpha-beta model against the algorithms' own messages.

Under ``--clock virtual`` every message costs the link's alpha + bytes/beta and nothing else does
(the lesson prices compute on a device model, where a collective's additions ride in the transfer,
as NCCL's kernels fuse them), so a run of the real tree, ring and halving-doubling code takes
exactly the time the textbook formulas give -- for p a power of two (L = log2 p, N bytes):

    tree              2L·alpha + 2L·N/beta                 reduce up a binomial tree, broadcast down
    ring              2(p-1)·alpha + 2(p-1)/p·N/beta       2(p-1) steps of one chunk
    halving-doubling  2L·alpha + 2(p-1)/p·N/beta           the tree's rounds, the ring's bytes

``crossover_section`` sweeps message sizes around the model's crossover and finds where the
measured times cross; ``ring_scaling`` runs the ring on groups of 2, 4, ... p ranks at once.
"""

from __future__ import annotations

import math

from minidist.comm import all_reduce

ALGORITHMS = ("tree", "ring", "halving_doubling")
FORMULAS = {"tree": "2L·alpha + 2L·N/beta", "ring": "2(p-1)·alpha + 2(p-1)/p·N/beta",
            "halving_doubling": "2L·alpha + 2(p-1)/p·N/beta"}
NAMES = {"tree": "tree", "ring": "ring", "halving_doubling": "halving-doubling"}
TOLERANCE = 0.01  # measured vs model: the clock is exact; 1% leaves room for a float's last bits


def coefficients(algorithm: str, p: int) -> tuple[float, float]:
    """(rounds, bytes factor) of the model: time = rounds·alpha + factor·N/beta (p a power of two)."""
    if p < 2 or p & (p - 1):
        raise ValueError(f"the tree and halving-doubling formulas need p a power of two >= 2, got {p}")
    L = p.bit_length() - 1
    return {"tree": (2 * L, 2 * L), "ring": (2 * (p - 1), 2 * (p - 1) / p),
            "halving_doubling": (2 * L, 2 * (p - 1) / p)}[algorithm]


def model(algorithm: str, p: int, nbytes: float, alpha: float, bandwidth: float) -> float:
    """The alpha-beta model's seconds for one all-reduce of ``nbytes`` per rank over ``p`` ranks."""
    rounds, factor = coefficients(algorithm, p)
    return rounds * alpha + factor * nbytes / bandwidth


def crossover(a: str, b: str, p: int, alpha: float, bandwidth: float) -> float | None:
    """The message size (bytes) at which ``a`` and ``b`` take equal time, if they cross at N > 0.
    Both are lines in N; tree and ring cross at alpha·beta·(p-1-L) / (L - (p-1)/p)."""
    (ra, fa), (rb, fb) = coefficients(a, p), coefficients(b, p)
    if fa == fb or ra == rb:
        return None
    n = (rb - ra) * alpha * bandwidth / (fa - fb)
    return n if n > 0 else None


def measured_crossover(sizes, ta, tb) -> float | None:
    """Where two measured curves cross: between the sizes where ``ta - tb`` changes sign, the
    straight line through the two measurements of each (exact when both are lines in N)."""
    for i in range(len(sizes) - 1):
        d0, d1 = ta[i] - tb[i], ta[i + 1] - tb[i + 1]
        if d0 == 0:
            return sizes[i]
        if d0 * d1 < 0:
            return sizes[i] + d0 / (d0 - d1) * (sizes[i + 1] - sizes[i])
    return None


def sync_clocks(comm) -> float:
    """Set every rank's virtual clock to one time T, later than any rank's now even after the
    messages of this agreement (two all-gathers; T leaves twice their span): a start for all."""
    first = comm.allgather_obj(comm.clock.now())
    second = comm.allgather_obj(comm.clock.now())
    start = max(second) + 2 * (max(second) - min(first)) + 1e-3
    comm.clock.resume(start)
    return start


def virtual_seconds(comm, fn) -> float:
    """Virtual seconds from a common start until the last rank has ``fn()``'s result (collective)."""
    start = sync_clocks(comm)
    fn()
    return max(comm.allgather_obj(comm.clock.now())) - start


def sizes_around(n: float, p: int, count: int = 8) -> list[int]:
    """``count`` message sizes (bytes, powers of two times 4p: whole float32 chunks) from about n/8
    to n·16, so the crossover n lies between two of them."""
    k = max(math.floor(math.log2(max(n, 1) / (4 * p))) - 3, 0)
    return [4 * p << (k + i) for i in range(count)]


def _size(n: float) -> str:
    return f"{n / 2**20:.3g} MB" if n >= 2**20 else f"{n / 2**10:.3g} KB" if n >= 2**10 else f"{n:.0f} B"


def crossover_section(comm) -> tuple[list[str], bool]:
    """Tree, ring and halving-doubling on the virtual clock at sizes around the model's tree/ring
    crossover: model / measured per size, the fastest, and the two crossovers. Collective; the lines
    are rank 0's to print, ``ok`` every measurement within TOLERANCE and the crossover found there."""
    import numpy as np

    p, link = comm.size, comm.clock.link
    alpha, bw = link.alpha, link.bandwidth
    if p < 2 or p & (p - 1):
        return [f"(the crossover table needs p a power of two; p = {p} is not: try --ranks "
                f"{1 << (p.bit_length() - 1)})"], True
    n_star = crossover("tree", "ring", p, alpha, bw)
    sizes = sizes_around(n_star or 64 * alpha * bw, p)
    got = {a: [] for a in ALGORITHMS}
    for n in sizes:
        x = np.ones(n // 4, np.float32)
        for a in ALGORITHMS:
            got[a].append(virtual_seconds(comm, lambda a=a, x=x: all_reduce(comm, x, algorithm=a)))
    L = p.bit_length() - 1
    lines = [f"the alpha-beta model on this link, p = {p} (L = log2 p = {L}): alpha = {alpha * 1e6:g} us, "
             f"beta = {bw / 1e9:g} GB/s", *(f"  {NAMES[a]:<17} {f}" for a, f in FORMULAS.items()), "",
             "  time per all-reduce, us: the model / the virtual clock running the algorithm",
             f"  {'N':>9}" + "".join(f"{NAMES[a]:>27}" for a in ALGORITHMS) + "  fastest"]
    ok = True
    for i, n in enumerate(sizes):
        cells, best = [], min(ALGORITHMS, key=lambda a: got[a][i])
        for a in ALGORITHMS:
            want = model(a, p, n, alpha, bw)
            ok &= abs(got[a][i] - want) <= TOLERANCE * want
            cells.append(f"{want * 1e6:>10.1f} / {got[a][i] * 1e6:<10.1f}")
        lines.append(f"  {_size(n):>9}" + "".join(f"{c:>27}" for c in cells) + f"  {NAMES[best]}")
    seen = measured_crossover(sizes, got["tree"], got["ring"])
    bracket = next((f" (between {_size(a)} and {_size(b)})" for a, b in zip(sizes, sizes[1:])
                    if seen is not None and a <= seen <= b), "")
    if n_star is None:
        lines.append("  tree vs ring: no crossover at p = 2 (the same rounds, the ring sends half the bytes)")
        ok &= seen is None
    else:
        hit = seen is not None and abs(seen - n_star) <= TOLERANCE * n_star
        ok &= hit
        lines.append(f"  tree -> ring: the model crosses at N* = alpha·beta·(p-1-L)/(L-(p-1)/p) = "
                     f"{_size(n_star)};\n  the clock's times cross at {_size(seen) if seen else 'no size'}"
                     f"{bracket}  {'PASS' if hit else 'FAIL'}")
    lines.append("  halving-doubling: the tree's 2L rounds and the ring's bytes, so the fastest at every "
                 "size (on these links\n  a partner far away costs what a neighbour does; on a ring or "
                 "torus of links it would share them)")
    return lines, ok


def ring_scaling(comm, nbytes: int) -> tuple[list[str], bool]:
    """The ring on groups of g = 2, 4, ... ranks (p a power of two; all groups at once): its virtual
    time beside 2(g-1)·alpha + 2(g-1)/g·N/beta. Collective; rank 0's lines, and ``ok``."""
    import numpy as np

    link, rows, ok = comm.clock.link, [], True
    g = 2
    while g <= comm.size:
        group = comm.split(comm.rank // g, comm.rank)
        x = np.ones(nbytes // 4, np.float32)
        t = virtual_seconds(group, lambda group=group, x=x: all_reduce(group, x, algorithm="ring"))
        want = model("ring", g, nbytes, link.alpha, link.bandwidth)
        ok &= abs(t - want) <= TOLERANCE * want
        latency, transfer = 2 * (g - 1) * link.alpha, 2 * (g - 1) / g * nbytes / link.bandwidth
        rows.append(f"  {g:>5} {latency * 1e6:>12.1f} {transfer * 1e6:>15.1f} {want * 1e6:>12.1f} "
                    f"{t * 1e6:>12.1f} {t / want:>7.3f}")
        g *= 2
    head = [f"the ring all-reduce of N = {_size(nbytes)} as p grows (groups of p ranks, at once): "
            f"2(p-1)·alpha + 2(p-1)/p·N/beta", f"  {'p':>5} {'2(p-1)alpha':>12} {'2(p-1)/p N/beta':>15} "
            f"{'formula us':>12} {'clock us':>12} {'ratio':>7}"]
    verdict = [f"  every p within {TOLERANCE:.0%} of the formula: {'PASS' if ok else 'FAIL'} (the alpha term "
               "grows with p, the bytes approach 2N)"]
    return head + rows + verdict, ok
