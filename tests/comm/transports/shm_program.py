"""Run under ``mpirun -n P`` by test_shm.py: ``python shm_program.py MODE``.

check:           shm_all_reduce == the rank-order NumPy reduction, to the bit and alike on every rank,
                 for every op, dtype and shape; pieces, two-shot, sub-communicators, async, debug mode,
                 the ledger; prints "OK rank r".
dtype_mismatch:  float64[8] against float32[16] -> CollectiveMismatch naming both calls.
size_mismatch:   float64[8] against float64[9] -> MessageMismatch naming both sizes.
skipped:         rank 0 broadcasts first, rank 1 goes straight to the all-reduce -> CollectiveMismatch.
early_return:    rank 1 returns from run() while rank 0 waits in the all-reduce -> RankExited.
stuck:           rank 0 in its 2nd all-reduce, rank 1 in a recv -> "still waiting", then the watchdog.
killed:          rank 1 is killed (SIGKILL) while rank 0 waits in the all-reduce -> the job ends.
"""

import hashlib
import os
import signal
import sys

import ml_dtypes
import numpy as np

from minidist.comm import all_reduce, all_reduce_async, broadcast, cost, measure, run, split_sizes

FNS = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum}
DTYPES = ("float16", "float32", "float64", "int32", "int64", "uint8", ml_dtypes.bfloat16)
SHAPES = ((), (0,), (1,), (7,), (3, 5), (2, 0, 3), (1000,), (257, 3))


def inputs(p: int, shape, dtype, seed: int) -> list:
    """Every rank's array (the same stream on every rank: each knows all of them)."""
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind in "iu":
        return [rng.integers(0, 50, shape).astype(dtype) for _ in range(p)]
    return [(rng.standard_normal(shape) * 100).astype(dtype) for _ in range(p)]


def reference(xs: list, op: str) -> np.ndarray:
    """Rank 0's array combined with rank 1's, then rank 2's, ... (then / p for the mean): the order
    every rank must add in, so the bits are exactly these."""
    acc = np.array(xs[0], copy=True)
    for x in xs[1:]:
        acc = FNS[op](acc, x)
    return acc / len(xs) if op == "mean" else acc


def bits(y: np.ndarray) -> bytes:
    return np.ascontiguousarray(y).tobytes()


def same_everywhere(comm, y: np.ndarray) -> bool:
    return len(set(comm.allgather_obj(hashlib.sha1(bits(y)).hexdigest()))) == 1


def agree(comm, x, want, op, algorithm="shm", what=""):
    y = all_reduce(comm, x, op=op, algorithm=algorithm)
    assert y.dtype == want.dtype and y.shape == want.shape, (what, y.dtype, y.shape, want.shape)
    assert bits(y) == bits(want), (what, op, y.ravel()[:4], want.ravel()[:4])
    assert same_everywhere(comm, y), what


def check_every_op_dtype_shape(comm, seed: int):
    p, r = comm.size, comm.rank
    for dtype in DTYPES:
        for shape in SHAPES:
            for op in ("sum", "mean", "max", "min"):
                if op == "mean" and np.dtype(dtype).kind in "iu":
                    continue
                xs = inputs(p, shape, dtype, seed)
                agree(comm, xs[r], reference(xs, op), op, what=f"{dtype} {shape}")
    xs = inputs(p, (40, 6), "float64", seed)                       # a non-contiguous input
    agree(comm, xs[r][::3, 1:4], reference([x[::3, 1:4] for x in xs], "sum"), "sum", what="strided")


def check(comm):
    p, r = comm.size, comm.rank
    assert comm.transport == "mpi"
    with measure(comm) as m:
        agree(comm, np.full(3, float(r)), np.full(3, float(sum(range(p)))), "sum", "auto", "auto")
    assert [c.name for c in m.calls] == ["shm_all_reduce"], m.calls  # auto picks shared memory
    check_every_op_dtype_shape(comm, seed=0)

    n = 5000  # the ledger: N written into the window, (p-1) N read from the others, one wait
    with measure(comm) as m:
        all_reduce(comm, np.ones(n, np.float32))
    assert (m.bytes_sent, m.bytes_received, m.messages, m.steps) == (4 * n, 4 * (p - 1) * n, 1, 1), m
    assert cost.all_reduce_bytes_sent("shm", 4 * n, p, r) == 4 * n

    n, first = 1_200_000, comm.shm.cap // 4  # 4.8 MB: a window of 4 MiB takes two pieces
    xs = inputs(p, (n,), "float32", 1)
    with measure(comm) as m:
        agree(comm, xs[r], reference(xs, "sum"), "sum", what="two pieces")
    assert first == 1 << 20, first
    if p == 2:  # one-shot: writes N, reads the other's N, one wait per piece
        assert (m.bytes_sent, m.bytes_received, m.steps) == (4 * n, 4 * n, 2), m
    else:       # both pieces >= 512 KB: two-shot writes N + its chunk, reads (p-1) chunks + the rest
        pieces = (first, n - first)
        chunks = [split_sizes(k, p)[r] for k in pieces]
        received = sum((p - 1) * c + k - c for k, c in zip(pieces, chunks))
        assert (m.bytes_sent, m.bytes_received, m.steps) == (4 * (n + sum(chunks)), 4 * received, 4), m

    crowded = p > len(os.sched_getaffinity(0))  # beyond one piece auto keeps shm only when crowded
    with measure(comm) as m:
        agree(comm, xs[r], reference(xs, "sum"), "sum", "auto", "auto beyond one piece")
    assert (m.calls[0].name == "shm_all_reduce") == crowded, (crowded, m.calls)

    saved, comm.shm.two_shot_from = comm.shm.two_shot_from, 0  # two-shot: N + |chunk r| per piece, 2 steps
    with measure(comm) as m:
        agree(comm, xs[r], reference(xs, "sum"), "sum", what="two pieces, two-shot")
    comm.shm.two_shot_from = saved
    chunk = split_sizes(first, p)[r] + split_sizes(n - first, p)[r]
    assert (m.bytes_sent, m.steps) == (4 * (n + chunk), 4), m

    # a window of 4 KB (many pieces) on a sub-communicator, everything two-shot: uneven chunks
    os.environ["MINIDIST_SHM_BYTES"] = "4096"
    small = comm.split(0, key=r)
    assert small.shm is None and all_reduce(small, np.ones(1))[0] == p and small.shm.cap == 4096
    small.shm.two_shot_from = 0
    check_every_op_dtype_shape(small, seed=2)
    xs = inputs(p, (10_001,), "float64", 3)                           # 20 pieces, the last one short
    with measure(small) as m:
        agree(small, xs[r], reference(xs, "mean"), "mean", what="pieces")
    assert m.steps == 2 * 20, m
    del os.environ["MINIDIST_SHM_BYTES"]

    if p % 2 == 0:  # pairs: their own windows, all of them in use at once
        pair = comm.split(r // 2, key=r)
        xs = inputs(p, (64,), "float32", 4)
        mine = xs[r // 2 * 2:r // 2 * 2 + 2]
        agree(pair, mine[pair.rank], reference(mine, "sum"), "sum", "auto", "pair")
        assert pair.shm is not comm.shm

    # async (a worker thread, its own lane) while the main thread all-reduces too; a fresh group whose
    # window the worker allocates first
    for group in (comm, comm.split(0, key=r)):
        xs = inputs(p, (2000,), "float64", 5)
        handles = [all_reduce_async(group, xs[r] * k, algorithm="auto") for k in range(1, 4)]
        agree(group, xs[r], reference(xs, "sum"), "sum", what="main beside async")
        for k, h in enumerate(handles, 1):
            assert np.array_equal(h.wait(), reference([x * k for x in xs], "sum")), k

    comm.debug = True  # debug mode takes the collective() path: same bits, same ledger
    xs = inputs(p, (33,), "float32", 6)
    with measure(comm) as m:
        agree(comm, xs[r], reference(xs, "max"), "max", "auto", "debug")
    comm.debug = False
    assert (m.bytes_sent, m.steps, [c.name for c in m.calls]) == (4 * 33, 1, ["shm_all_reduce"]), m
    comm.barrier()
    print(f"OK rank {r}", flush=True)


def dtype_mismatch(comm):
    x = np.ones(8) if comm.rank == 0 else np.ones(16, np.float32)
    print(f"rank {comm.rank} got {all_reduce(comm, x, algorithm='shm')}", flush=True)


def size_mismatch(comm):
    print(f"rank {comm.rank} got {all_reduce(comm, np.ones(8 + comm.rank), algorithm='shm')}", flush=True)


def skipped(comm):
    all_reduce(comm, np.ones(2), algorithm="shm")
    if comm.rank == 0:
        broadcast(comm, np.ones(2))
    print(f"rank {comm.rank} got {all_reduce(comm, np.ones(6), algorithm='shm')}", flush=True)


def early_return(comm):
    all_reduce(comm, np.ones(3), algorithm="shm")
    if comm.rank != 1:
        all_reduce(comm, np.ones(3), algorithm="shm")


def stuck(comm):
    all_reduce(comm, np.ones(3), algorithm="shm")
    if comm.rank == 0:
        all_reduce(comm, np.ones(3), algorithm="shm")
    else:
        comm.recv(0, tag=3)


def killed(comm):
    all_reduce(comm, np.ones(3), algorithm="shm")
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    all_reduce(comm, np.ones(3), algorithm="shm")


if __name__ == "__main__":
    modes = {f.__name__: f for f in (check, dtype_mismatch, size_mismatch, skipped, early_return, stuck,
                                     killed)}
    run(modes[sys.argv[1]])
    print(f"AFTER RUN {sys.argv[1]}", flush=True)
