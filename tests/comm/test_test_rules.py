"""The test suite's own rules (tests/conftest.py), checked in a child pytest: a hung collective in a
hypothesis test fails at its first hung example (no shrinking), and mpi-marked tests never skip
silently when mpirun is missing."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

HANGS = '''
import json, numpy as np
from hypothesis import given, settings, strategies as st
from minidist.comm import all_reduce, run

@settings(max_examples=20, derandomize=True, database=None)
@given(n=st.integers(0, 10))
def test_hangs_from_3_on(n):
    with open(__file__ + ".calls", "a") as f:
        f.write(json.dumps(n) + "\\n")
    def body(comm):
        if comm.rank == 0 or n < 3:
            all_reduce(comm, np.ones(2), algorithm="ring")
        else:
            comm.recv(0, tag=1)  # rank 0 waits for rank 1 in the all-reduce, rank 1 for rank 0: a hang
    run(body, ranks=2)
'''

NEEDS_MPI = '''
import pytest

@pytest.mark.mpi
def test_needs_mpi():
    pass
'''


def child_pytest(path, **env):
    e = {k: v for k, v in os.environ.items() if k != "MINIDIST_REQUIRE_MPI"}  # CI sets it; each case says
    e.update(PYTHONPATH=str(ROOT), **env)
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "tests.conftest", "-p", "no:cacheprovider",
           "-m", "", str(path)]  # -m "": the slow set too (pyproject's addopts leave mpi tests out)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=e, cwd=ROOT)


def test_hangs_fail_at_once_without_shrinking_and_mpi_tests_never_skip_silently(tmp_path):
    (tmp_path / "test_hang_probe.py").write_text(HANGS)
    (tmp_path / "test_mpi_probe.py").write_text(NEEDS_MPI)
    no_mpirun = "/usr/bin:/bin"  # the venv's bin (which holds mpirun) left out
    res = child_pytest(tmp_path, PATH=no_mpirun, MINIDIST_TIMEOUT="2")
    assert "RanksHung: watchdog: rank" in res.stdout, res.stdout + res.stderr
    calls = [int(n) for n in (tmp_path / "test_hang_probe.py.calls").read_text().split()]
    assert sum(n >= 3 for n in calls) == 1, calls  # one hung example, then stop: no shrinking
    assert "1 failed, 1 skipped" in res.stdout and "needs mpirun on PATH" in res.stdout, res.stdout
    res = child_pytest(tmp_path / "test_mpi_probe.py", PATH=no_mpirun, MINIDIST_REQUIRE_MPI="1")
    assert res.returncode != 0 and "MINIDIST_REQUIRE_MPI=1 but mpirun is not on PATH" in res.stdout, \
        res.stdout
