"""The shared-memory all-reduce (minidist/comm/transports/shm.py) under real ``mpirun``, and its place
in auto.

The mpirun jobs run shm_program.py: results are compared bit for bit with the rank-order NumPy
reduction written out there; failures must end the job in seconds with an error naming the ranks.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist.comm import all_reduce, cost, measure, run

ROOT = Path(__file__).resolve().parents[3]
PROGRAM = Path(__file__).with_name("shm_program.py")


def mpirun(n, mode, timeout=90, **env):
    e = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT), **env)
    for k in ("MINIDIST_TRANSPORT", "MINIDIST_LINK", "MINIDIST_SHM", "MINIDIST_SHM_BYTES", "MINIDIST_DEBUG"):
        e.pop(k, None)
    cmd = ["mpirun", "-n", str(n), sys.executable, str(PROGRAM), mode]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e)


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 4])
def test_shm_all_reduce_is_exact_and_alike_on_every_rank(n):
    """Every op, dtype (bfloat16 too) and shape (0-d, empty, strided), pieces, two-shot, pairs,
    async beside blocking, debug mode, and the ledger's numbers: see shm_program.check."""
    res = mpirun(n, "check")
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(int(r) for r in re.findall(r"OK rank (\d+)", res.stdout)) == list(range(n))


MPI_FAILURES = {
    "dtype_mismatch": r"CollectiveMismatch: rank [01] of 2 \(mpi\), in shm_all_reduce #1: waits for a "
                      r"message of shm_all_reduce call #1 .*dtype float(32|64).* next message .*float(32|64)",
    "size_mismatch": r"MessageMismatch: rank [01] of 2 \(mpi\), in shm_all_reduce #1: rank [01] all-reduces "
                     r"(64|72) bytes, this rank (64|72)",
    "skipped": r"CollectiveMismatch: rank [01] of 2 \(mpi\), in shm_all_reduce #[23]: waits for .*call #[23] "
               r".*next message is .*shm_all_reduce call #[23]",
    "early_return": r"RankExited: rank 0 of 2 \(mpi\), in shm_all_reduce #2: rank 1 returned from run\(\)",
    "stuck": r"rank 0 of 2 \(mpi\): still waiting after [12] s in shm_all_reduce #2 for rank 1 to post(.|\n)*"
             r"watchdog: rank 0 of 2 \(mpi\) waited",
    "killed": r"BAD TERMINATION|Killed",
}


@pytest.mark.mpi
@pytest.mark.parametrize("mode", list(MPI_FAILURES))
def test_shm_failures_end_the_job_with_the_ranks_named(mode):
    """A peer in another call (dtype, size, a skipped call), gone (returned, killed) or stuck: an error
    in seconds, never a hang or a wrong sum."""
    res = mpirun(2, mode, 60, MINIDIST_TIMEOUT="2" if mode == "stuck" else "60")
    assert res.returncode != 0, res.stdout + res.stderr
    assert re.search(MPI_FAILURES[mode], res.stderr + res.stdout), res.stderr
    assert "got [" not in res.stdout and "AFTER RUN" not in res.stdout


def test_shm_elsewhere_is_autos_choice():
    """On the threads transport (no shared window) ``algorithm="shm"`` runs what auto picks."""
    def body(comm):
        with measure(comm) as m:
            y = all_reduce(comm, np.full(10, comm.rank + 1.0), algorithm="shm")
        return y.tolist(), [c.name for c in m.calls]

    want = f"{cost.choose_algorithm(80, 3)}_all_reduce"
    assert run(body, ranks=3) == [([6.0] * 10, [want])] * 3
    assert run(body, ranks=1) == [([1.0] * 10, ["shm_all_reduce"])]  # one rank: a copy, nothing to add


def test_shm_cost_counts_are_the_protocols():
    """Per piece: one-shot writes N, reads (p-1)N, one wait; two-shot (4 ranks, from 512 KB, whether
    or not ranks outnumber cores) also writes its reduced chunk, reads about 2N, two waits. Auto
    picks shm only where it can run."""
    assert cost.all_reduce_counts("shm", 4096, 2) == (1, 1, 4096, 4096)
    assert cost.all_reduce_counts("shm", 1 << 20, 2) == (1, 1, 1 << 20, 1 << 20)
    assert cost.all_reduce_counts("shm", 4096, 4) == (1, 1, 4096, 3 * 4096)
    assert cost.all_reduce_counts("shm", (512 << 10) - 4, 4) == (1, 1, (512 << 10) - 4, 3 * ((512 << 10) - 4))
    assert cost.all_reduce_counts("shm", 1 << 20, 4) == (2, 1, 1.25 * (1 << 20), 0.75 * (1 << 20))
    assert cost.all_reduce_bytes_sent("shm", 1 << 20, 4, 3) == 1.25 * (1 << 20)
    assert cost.auto_algorithm(4096, 4, False, shared_memory=True) == "shm"
    assert cost.auto_algorithm(4096, 1, False, shared_memory=True) == cost.choose_algorithm(4096, 1, False)
    assert cost.auto_algorithm(1 << 24, 4, False) == cost.choose_algorithm(1 << 24, 4, False)
    # beyond one window's piece: shm only when ranks outnumber cores
    assert cost.auto_algorithm(4 << 20, 2, False, True, window=4 << 20) == "shm"
    assert cost.auto_algorithm((4 << 20) + 4, 2, False, True, window=4 << 20) == "ring"
    assert cost.auto_algorithm(1 << 26, 4, True, True, window=4 << 20) == "shm"


# -- the protocol alone, fast: thread ranks given lanes over plain shared NumPy memory --------------

def thread_lanes(p: int, cap: int, two_shot_from: float) -> list:
    """What ``shm.Window`` makes, for thread ranks of one process: their memory is already shared."""
    from minidist.comm.transports.shm import HEADER, LANES, Lane

    slots = [np.zeros(LANES * (HEADER + 2 * cap), np.uint8) for _ in range(p)]
    return [Lane(slots, cap, r, None, two_shot_from) for r in range(p)]


def rank_order(xs: list, op: str) -> np.ndarray:
    """Rank 0's array combined with rank 1's, then rank 2's, ...: the bits every rank must get."""
    fn = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum}[op]
    acc = xs[0]
    for x in xs[1:]:
        acc = fn(acc, x)
    return acc / len(xs) if op == "mean" else acc


@given(p=st.integers(2, 4), shape=st.lists(st.integers(0, 40), max_size=2).map(tuple),
       dtype=st.sampled_from(["float16", "float32", "float64", "int32", "uint8"]),
       op=st.sampled_from(["sum", "mean", "max", "min"]), cap=st.sampled_from([64, 128, 4096]),
       two_shot=st.booleans(), calls=st.integers(1, 4))
def test_shm_protocol_is_exact_for_any_window(p, shape, dtype, op, cap, two_shot, calls):
    """Pieces of any window size, one-shot and two-shot, several calls in a row (both parities):
    bit for bit the rank-order reduction on every rank; the ledger's bytes and steps per piece."""
    if op == "mean" and dtype in ("int32", "uint8"):
        op = "sum"
    lanes = thread_lanes(p, cap, 0 if two_shot else float("inf"))
    rng = np.random.default_rng(len(shape) + p)
    xss = [[(rng.standard_normal(shape) * 50).astype(dtype) for _ in range(p)] for _ in range(calls)]

    def body(comm):
        comm.shm = lanes[comm.rank]
        comm.timeout = 2  # (a rank that raised leaves its peers waiting on its header: not for 20 s)
        with measure(comm) as m:
            ys = [all_reduce(comm, xs[comm.rank], op=op, algorithm="shm") for xs in xss]
        return [y.tobytes() for y in ys], m.bytes_sent, m.steps

    n = int(np.prod(shape, dtype=np.int64))
    item = np.dtype(dtype).itemsize
    pieces = [len(range(lo, min(n, lo + cap // item))) for lo in range(0, max(n, 1), cap // item)]
    for r, (ys, sent, steps) in enumerate(run(body, ranks=p)):
        assert ys == [rank_order(xs, op).tobytes() for xs in xss]
        chunks = sum(k // p + (r < k % p) for k in pieces) if two_shot else 0
        assert (sent, steps) == (calls * item * (n + chunks), calls * len(pieces) * (2 if two_shot else 1))


def test_shm_protocol_stages_other_backends_like_every_collective():
    """A JAX array goes through ``collective``'s host staging (not the NumPy-only lean path) and
    comes back a JAX array, with the same ledger."""
    jax = pytest.importorskip("jax")
    lanes = thread_lanes(2, 4096, float("inf"))

    def body(comm):
        comm.shm = lanes[comm.rank]
        x = comm.backend.from_host(np.arange(6.0).reshape(2, 3) * (comm.rank + 1))
        with measure(comm) as m:
            y = all_reduce(comm, x, op="mean", algorithm="shm")
        return isinstance(y, jax.Array), np.asarray(y).tolist(), m.bytes_sent, m.steps

    want = (np.arange(6.0).reshape(2, 3) * 3 / 2).tolist()
    assert run(body, ranks=2, backend="jax") == [(True, want, 48, 1)] * 2


@pytest.mark.parametrize("extra,want", [(0, 1 << 20), (-1, 1 << 19)])
def test_window_is_halved_only_while_p_ranks_windows_exceed_half_the_free_space(monkeypatch, extra, want):
    """4 ranks of 1 MiB parity buffers take 4 x 2 lanes x (64 + 2 MiB); that must be at most half of
    what /dev/shm has free. Exactly twice that free: kept; one byte less: halved to 512 KiB."""
    from types import SimpleNamespace

    from minidist.comm.transports import shm

    need = 4 * 2 * (64 + 2 * (1 << 20))
    monkeypatch.setenv("MINIDIST_SHM_BYTES", str(1 << 20))
    monkeypatch.setattr(shm.os, "statvfs", lambda _: SimpleNamespace(f_bavail=2 * need + extra, f_frsize=1))
    assert shm.window_bytes(4) == want


@pytest.mark.parametrize("offset,steps", [(0, 2), (1, 1)])
def test_a_piece_of_exactly_the_two_shot_size_goes_two_shot(offset, steps):
    """Two-shot from 256 bytes: a 256-byte piece (64 float32) takes two waits, one byte above its size
    as the threshold keeps it one-shot; the result is the rank-order sum either way."""
    lanes = thread_lanes(3, 4096, 256 + offset)
    xs = [np.arange(64, dtype=np.float32) * (r + 1) for r in range(3)]

    def body(comm):
        comm.shm = lanes[comm.rank]
        comm.timeout = 2
        with measure(comm) as m:
            y = all_reduce(comm, xs[comm.rank], algorithm="shm")
        return y, m.steps

    for y, got in run(body, ranks=3):
        np.testing.assert_array_equal(y, rank_order(xs, "sum"))
        assert got == steps
