"""A few real ``mpirun`` jobs (2, 4, 8 processes): same results on the MPI transport; no hangs."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = Path(__file__).with_name("mpi_program.py")
pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun (pip install mpich)")]


def mpirun(n, mode, timeout=60, **env):
    e = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT), **env)
    e.pop("MINIDIST_TRANSPORT", None)
    cmd = ["mpirun", "-n", str(n), sys.executable, str(PROGRAM), mode]
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


def test_watchdog_under_mpi():
    res = mpirun(2, "stuck", timeout=30, MINIDIST_TIMEOUT="1")
    assert res.returncode != 0
    # whichever rank's watchdog fires first names itself, what it waited for and its last operation
    assert re.search(r"watchdog: rank [01] of 2 \(mpi\) waited", res.stderr), res.stderr
    assert "rank 0: recv from 1 tag 7" in res.stderr or "rank 1: barrier" in res.stderr
