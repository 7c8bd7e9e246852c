"""A few real ``mpirun`` jobs (2, 4, 8 processes): same results on the MPI transport; no hangs."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = Path(__file__).with_name("mpi_program.py")
pytestmark = pytest.mark.mpi  # skipped without mpirun (or failed under MINIDIST_REQUIRE_MPI=1): conftest


def mpirun(n, mode, timeout=60, *args, **env):
    e = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT), **env)
    e.pop("MINIDIST_TRANSPORT", None)
    cmd = ["mpirun", "-n", str(n), sys.executable, str(PROGRAM), mode, *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_collectives_under_mpirun(n):
    res = mpirun(n, "check")
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(int(r) for r in re.findall(r"OK rank (\d+)", res.stdout)) == list(range(n))


def test_exception_on_one_rank_ends_the_job():
    res = mpirun(4, "fail", timeout=30)
    assert res.returncode != 0
    assert "rank 1 of 4 raised" in res.stderr and "deliberate failure on rank 1" in res.stderr


def test_watchdog_under_mpi_names_each_ranks_real_operation():
    """Rank 0 is inside its 2nd all-reduce, rank 1 in a recv: each one's early "still waiting" line
    and watchdog error name its real operation (the watchdog once said "start" inside a collective)."""
    res = mpirun(2, "stuck_in_collective", timeout=30, MINIDIST_TIMEOUT="2")
    assert res.returncode != 0
    assert re.search(r"watchdog: rank [01] of 2 \(mpi\) waited", res.stderr), res.stderr
    err = res.stderr
    assert re.search(r"rank 0 of 2 \(mpi\): still waiting after [12] s in ring_all_reduce #2", err), err
    assert re.search(r"rank 1 of 2 \(mpi\): still waiting after [12] s in recv from 0 tag 3", err), err
    assert "rank 0: ring_all_reduce #2" in res.stderr or "rank 1: recv from 0 tag 3" in res.stderr
    assert "rank 0: start" not in res.stderr and "AFTER RUN" not in res.stdout


def test_a_long_serial_twin_on_rank_0_is_no_hang_under_mpi():
    """Rank 0 computes 3 s while 3 ranks wait in a broadcast, with the deadlock line due after 2.5 s
    (MINIDIST_TIMEOUT=5): they see on the shared board that rank 0 works, so nothing is printed."""
    res = mpirun(4, "long_twin", 60, MINIDIST_TIMEOUT="5")
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("got twin done") == 4 and "still waiting" not in res.stderr, res.stderr


def test_a_hang_under_mpi_says_every_rank_is_waiting():
    res = mpirun(2, "stuck_in_collective", timeout=30, MINIDIST_TIMEOUT="2")
    says = r"rank [01] of 2 \(mpi\): still waiting after [12] s .*; every rank is waiting"
    assert re.search(says, res.stderr), res.stderr


@pytest.mark.parametrize("mode,expected", [
    ("dtype_mismatch", r"CollectiveMismatch: rank [01] of 2 \(mpi\), in ring_all_reduce #1: waits for a "
                       r"message of ring_all_reduce call #1 .*dtype float(32|64)"),
    ("early_return", r"RankExited: rank 0 of 2 \(mpi\), in ring_all_reduce #1: rank 1 returned from run\(\)"),
    ("exit0", r"rank 1 of 2 called os._exit\(0\) before its function returned from run\(\)"),
    ("after_abort", r"rank 1 of 2 raised; aborting the job"),
], ids=["dtype_mismatch", "early_return", "exit0", "after_abort"])
def test_mpi_jobs_fail_fast_and_truthfully(mode, expected, tmp_path):  # ids: the modes
    """MPI-only failures that once gave garbage, a 300 s hang, or exit code 0: each ends the job in
    seconds with a nonzero exit code and a message naming the rank; no rank that failed (or whose
    peer failed) carries on past run()."""
    res = mpirun(2, mode, 30, tmp_path / "after_run", MINIDIST_TIMEOUT="60")
    assert res.returncode != 0, res.stdout + res.stderr
    assert re.search(expected, res.stderr), res.stderr
    assert "got [" not in res.stdout  # no garbage result printed
    assert "AFTER RUN" not in res.stdout and not list(tmp_path.glob("after_run.*"))  # nobody carried on


@pytest.mark.parametrize("n", [2, 4])
def test_the_virtual_clock_under_mpirun_keeps_the_hand_worked_times(n):
    """The same hand-worked timeline as on threads (tests/comm/test_clock.py), through MPI's messages:
    the arrival rides in the header, a stamp beside a raw message."""
    res = mpirun(n, "clock", 60, MINIDIST_CLOCK="virtual", MINIDIST_LINK="alpha_us=1000,mbps=8")
    assert res.returncode == 0, res.stdout + res.stderr
    lines = re.findall(r"CLOCK rank (\d+) (.*)", res.stdout)
    got = {int(r): [float(x) for x in rest.split()] for r, rest in lines}
    slop, ring = 5e-3, 2 * (n - 1) * 1e-3 + 2 * (n - 1) / n * 48000 * n / 1e6  # N = 8 * 6000n bytes
    for want, t in zip([0.102, 0.402], got[0]):
        assert want <= t <= want + slop, got
    for want, t in zip([0.103, 0.203], got[1]):
        assert want <= t <= want + slop, got
    for r in range(n):
        assert ring <= got[r][-1] <= ring + 0.02, (ring, got)
