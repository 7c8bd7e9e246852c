"""How much of this machine the ranks get: cores' worth for threads (`effective_cores`, `thread_counts`)
and the threads transport's all-reduce link (`allreduce_alpha_beta`, fitted by `fit_link`), in wall time.
"""

from __future__ import annotations

import numpy as np

from minidist.comm import all_reduce, run
from minidist.nn import GPT, GPTConfig
from minidist.plan.clock import _median_time, cpu
from minidist.plan.estimates import fit_alpha_beta
from minidist.plan.steptime import LINK_RANKS
from minidist.plan.traffic import all_reduce_rounds, all_reduce_sent


def fit_link(algorithm: str, p: int, sizes, times) -> tuple[float, float]:
    """(alpha, beta) of time = rounds x alpha + bytes sent x beta over the message sizes (bytes of
    float32), rounds and bytes as the planner counts them (``minidist.plan.traffic``), fitted in
    *relative* error (``estimates.fit_alpha_beta``): a 4 KB all-reduce's time counts as much as a
    4 MB one's, a thousand times longer, so alpha comes from the small messages it dominates, not
    from the noise of the large ones (chapter 11: what plain least squares read on a busy machine)."""
    rounds = [all_reduce_rounds(algorithm, n, p) for n in sizes]
    sent = [all_reduce_sent(algorithm, n, p) for n in sizes]
    return fit_alpha_beta(rounds, sent, times, relative=True)


def allreduce_alpha_beta(ranks: int = LINK_RANKS) -> tuple[float, float]:
    sizes = [1 << 10, 1 << 16, 1 << 20, 1 << 22]

    def body(comm):
        out = []
        for nbytes in sizes:
            x = np.ones(nbytes // 4, np.float32)
            out.append(_median_time(lambda x=x: all_reduce(comm, x, algorithm="ring"), 7, min_time=0))
        return out
    times = np.array(run(body, ranks=ranks, transport="threads")).max(axis=0)
    return fit_link("ring", ranks, sizes, times)


def _work(minidist_ops: bool, batch: int = 8):
    """A unit of work: 40 plain 192x192 matmuls, or (`minidist_ops`) two forward + backward passes of a
    one-block minidist GPT (width 128, `batch` sequences of 64 tokens: every kind of op, at a lesson's
    sizes; small batches mean short kernels and many GIL hand-offs)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((192, 192)).astype(np.float32)
    model = GPT(GPTConfig(vocab_size=64, block_size=64, n_layer=1, n_head=4, d_model=128))
    ids = rng.integers(0, 64, (batch, 64))

    def work():
        if not minidist_ops:
            for _ in range(40):
                a @ a
            return
        for _ in range(2):
            model.loss(ids, ids).backward()
    return work


def effective_cores(threads: int, minidist_ops: bool = False, batch: int = 8) -> float:
    """How many cores' worth of work `threads` threads really get at once: the same work (`_work`) on
    one thread (its CPU seconds: what it needs), then on `threads` threads together (wall time), in
    three turns. Plain matmuls (NumPy releases the GIL inside
    BLAS): the core count on an idle machine, less when other programs keep the cores busy.
    `minidist_ops=True`: minidist layers, whose Python (autograd, small ops) runs one thread at a
    time -- what ranks on the threads transport get. (MPI processes: `minidist.plan.calibrate_mpi`.)"""
    import threading

    work = _work(minidist_ops, batch)

    def together():
        ts = [threading.Thread(target=work) for _ in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    ratios = []
    for _ in range(3):  # alone and together in turns: a burst of other work spoils one pair, not the median
        ratios.append(threads * _median_time(work, 3, min_time=0, clock=cpu) /  # what it needs alone
                      _median_time(together, 3, min_time=0))
    # below 1 is possible: handing the GIL over costs time of its own
    return max(0.01, min(float(threads), float(np.median(ratios))))  # never nothing at all


def thread_counts(cores: int) -> list:
    """The cores' worth of minidist's thread ranks per rank count: one alone (the share of a core a
    single rank gets: 1 on a quiet machine, less when other programs want the cores too), as many
    as the CPUs, 2 x and 4 x as many, each with a fixed global batch of 16 rows split over them
    (16 / ranks rows each, so the more ranks, the thinner the kernels and the more GIL hand-offs per
    FLOP -- what a fixed batch over a bigger mesh does)."""
    return [{"ranks": n, "cores": effective_cores(n, minidist_ops=True, batch=max(1, 16 // n))}
            for n in (1, cores, 2 * cores, 4 * cores)]

