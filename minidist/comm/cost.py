"""The alpha-beta cost model behind ``all_reduce(algorithm="auto")``: the seam a transport asks.

A round costs ``alpha`` (a message round trip, or -- when ranks outnumber cores -- waiting for the
partners to get a core), every message ``delta``, every byte sent ``beta``, every byte reduced ``gamma``:

    time = rounds·alpha + messages·delta + bytes_sent·beta + bytes_reduced·gamma   (per rank)

``all_reduce_counts`` holds each algorithm's rounds, messages and bytes (the table in chapter 2 and
in collectives.py; the shm one writes into shared memory instead of sending). Small messages
favour recursive doubling (fewest steps), large ones the ring or halving-doubling; the crossover
moves up by orders of magnitude when ranks share cores, because alpha does. The constants are
rough measurements of shared-memory MPI on a small machine: what matters is their ratio.

Every rank of a group must choose the same algorithm, or they wait for each other's messages
forever: ``crowded()`` looks at this host only, so a transport's choice (``choose_for``) asks
``agreed_crowded(comm)``, agreed once per communicator.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from minidist.comm.call import check_op

BETA = 1 / 2e9    # s per byte sent (~2 GB/s through shared memory)
GAMMA = 1 / 4e9   # s per byte reduced (~4 GB/s for a NumPy add of float32)
# (alpha, delta): s per round and per message, with a core per rank / with ranks outnumbering
# cores (then every round and every message waits until the partner is scheduled)
LATENCY = {False: (2e-5, 5e-6), True: (1e-4, 3e-5)}


# shm all-reduce: two-shot (each rank reads ~2N, two waits) from this many bytes per piece up,
# one-shot (reads p·N, one wait) below. At p = 2 both read 2N, so two-shot never pays. Chapter 2
# has the measurement behind the crossover; 512 KB is NCCL's kind of crossover.
SHM_TWO_SHOT_BYTES = {2: 1 << 62}
SHM_TWO_SHOT_DEFAULT = 512 << 10


def shm_two_shot_from(p: int) -> float:
    """The smallest piece (bytes) the shm all-reduce sends two-shot over ``p`` ranks."""
    return SHM_TWO_SHOT_BYTES.get(p, SHM_TWO_SHOT_DEFAULT)


def shm_two_shot(nbytes: int, p: int) -> bool:
    """Does the shm all-reduce use two-shot for a piece of ``nbytes`` over ``p`` ranks?"""
    return nbytes >= shm_two_shot_from(p)


@functools.cache
def crowded() -> bool:
    """More ranks on this host than cores the process may use (launched by mpirun)."""
    local = int(os.environ.get("MPI_LOCALNRANKS", os.environ.get("PMI_SIZE", "1")))
    return local > len(os.sched_getaffinity(0))


def agreed_crowded(comm) -> bool:
    """``crowded()`` on any rank of ``comm``: the same answer on every rank. Collective the first time
    (one all-gather of a bool on ``comm``'s private channel), then kept in ``comm.agreed_crowded``.
    Sub-communicators (``split``, a mesh's groups) agree among their own ranks."""
    flag = comm.agreed_crowded
    if flag is None:
        mine = bool(crowded())
        comm.note("all_reduce(auto): agreeing on crowded()")  # what the watchdog shows if a rank is missing
        flag = mine if comm.size == 1 else any(comm.channel("coll").allgather_obj(mine))
        comm.agreed_crowded = flag
    return flag


def all_reduce_counts(algorithm: str, nbytes: int, p: int) -> tuple:
    """(rounds, messages, bytes sent, bytes reduced) of the busiest rank, per the table above."""
    if p == 1:
        return 0, 0, 0.0, 0.0
    q = 1 << (p.bit_length() - 1)
    log_q = q.bit_length() - 1
    ring_bytes = 2 * (p - 1) / p * nbytes
    if algorithm == "ring":
        counts = 2 * (p - 1), 2 * (p - 1), ring_bytes, ring_bytes / 2
    elif algorithm == "two_shot":
        counts = 2, 2 * (p - 1), ring_bytes, ring_bytes / 2
    elif algorithm == "halving_doubling":
        q_bytes = 2 * (q - 1) / q * nbytes
        counts = 2 * log_q, 2 * log_q, q_bytes, q_bytes / 2
    elif algorithm == "recursive_doubling":
        counts = log_q, log_q, log_q * nbytes, log_q * nbytes
    elif algorithm == "shm":
        if shm_two_shot(nbytes, p):
            counts = 2, 1, nbytes + nbytes / p, (p - 1) / p * nbytes
        else:
            counts = 1, 1, nbytes, (p - 1) * nbytes
    else:
        raise ValueError(f"no cost model for {algorithm!r}")
    if p > q and algorithm in ("halving_doubling", "recursive_doubling"):  # the fold: 2 more steps of N
        rounds, messages, sent, reduced = counts
        counts = rounds + 2, messages + 2, sent + nbytes, reduced + nbytes
    return counts


def all_reduce_bytes_sent(algorithm: str, nbytes: int, p: int, r: int) -> int:
    """Bytes rank ``r`` of ``p`` sends in one all-reduce of ``nbytes`` (exact when p divides the
    element count). For p not a power of two, recursive doubling and halving-doubling first fold the
    2·rem lowest ranks in pairs (rem = p - q): the even one sends its N and sits out, the odd one
    also sends the result back at the end."""
    if p == 1:
        return 0
    if algorithm in ("ring", "two_shot"):
        return 2 * (p - 1) * nbytes // p
    if algorithm == "shm":
        return nbytes + nbytes // p if shm_two_shot(nbytes, p) else nbytes
    q = 1 << (p.bit_length() - 1)
    _, _, core, _ = all_reduce_counts(algorithm, nbytes, q)
    if r >= 2 * (p - q):
        return int(core)
    return nbytes if r % 2 == 0 else int(core) + nbytes


def all_reduce_cost(algorithm: str, nbytes: int, p: int, alpha: float, delta: float) -> float:
    """Predicted seconds for one rank to all-reduce ``nbytes`` over ``p`` ranks."""
    rounds, messages, sent, reduced = all_reduce_counts(algorithm, nbytes, p)
    return rounds * alpha + messages * delta + sent * BETA + reduced * GAMMA


def shm_wins(nbytes: int, window: int, is_crowded: bool) -> bool:
    """Does the shared-memory all-reduce beat the message algorithms for ``nbytes``, given a window
    of ``window`` bytes per piece? Up to one piece always: one wait, no protocol. Beyond, only when
    the ranks outnumber the cores, where every round of the ring waits for a time slice. With a core
    per rank the message algorithms win there: MPI moves a large message in one copy, while shm
    first copies all of x into the window and reads p copies (mpirun -n 2, 16 and 64 MB: shm 1.1x
    MPICH, the ring 1.5x and 2.3x; -n 4 on 2 cores: shm 1.6x and 1.4x, the ring 1.3x)."""
    return nbytes <= window or is_crowded


def auto_algorithm(nbytes: int, p: int, is_crowded: bool | None = None, shared_memory: bool = False,
                   window: int | None = None) -> str:
    """What ``all_reduce(algorithm="auto")`` runs: ``"shm"`` where shared memory serves the group
    (``shared_memory``: the MPI transport, every rank on one node, no emulated link) and ``shm_wins``
    (``window``: bytes per piece, ``shm.window_bytes(p)``; None: any message fits), else the cost
    model's choice (``choose_algorithm``)."""
    is_crowded = crowded() if is_crowded is None else is_crowded
    if shared_memory and p > 1 and shm_wins(nbytes, nbytes if window is None else window, is_crowded):
        return "shm"
    return choose_algorithm(nbytes, p, is_crowded)


@functools.lru_cache(maxsize=4096)  # called on every all-reduce: a small message can't wait for the model
def choose_algorithm(nbytes: int, p: int, is_crowded: bool | None = None) -> str:
    """The all-reduce algorithm the model predicts fastest (a tie goes to the simpler: at p = 2
    halving-doubling and the ring are the same exchange). ``is_crowded``: None asks this host's
    ``crowded()``; inside a group pass ``agreed_crowded(comm)``, so every rank chooses alike."""
    alpha, delta = LATENCY[crowded() if is_crowded is None else is_crowded]
    candidates = ("recursive_doubling", "ring", "halving_doubling", "two_shot")
    return min(candidates, key=lambda a: all_reduce_cost(a, nbytes, p, alpha, delta))


def check_before_handshake(comm, x, op, algorithm) -> None:
    """Debug mode: compare the ranks' calls before a handshake that a mismatch would hang."""
    if comm.debug and comm.size > 1:
        check_op(comm, op, x.dtype)
        comm.check_same_call({"collective": "all_reduce", "seq": comm.seq + 1, "size": comm.size,
                              "shape": tuple(np.shape(x)), "dtype": str(x.dtype), "op": op,
                              "algorithm": algorithm})


def choose_for(comm, x, op: str) -> str:
    """``all_reduce(algorithm="auto")`` on a message-passing transport: the model's fastest for x's
    size and this group, agreed by every rank (``agreed_crowded``; debug mode compares first)."""
    if comm.agreed_crowded is None:
        check_before_handshake(comm, x, op, "auto")
    return choose_algorithm(x.nbytes, comm.size, agreed_crowded(comm))
