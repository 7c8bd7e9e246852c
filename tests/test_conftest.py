"""The slow set of tests/conftest.py: what the default command leaves out is exactly the listed tests,
every `mpi` test and every `timing` test, and each list entry still names a real test (a renamed test
would otherwise drift back into the default set, or out of CI's sight)."""

import ast
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import SLOW, TIMING, _listed

ROOT = Path(__file__).resolve().parents[1]


def _item(nodeid, **params):
    return SimpleNamespace(nodeid=nodeid, callspec=SimpleNamespace(params=params) if params else None)


def test_a_prefix_or_a_files_jax_backend_is_listed_and_nothing_else():
    table = {"tests/a/test_x.py[jax]": "", "tests/b/test_y.py::test_long": ""}
    assert _listed(_item("tests/a/test_x.py::test_op[add-jax]", backend="jax"), table)
    assert not _listed(_item("tests/a/test_x.py::test_op[add-numpy]", backend="numpy"), table)
    assert not _listed(_item("tests/a/test_x.py::test_plain"), table)  # no parameters at all
    assert not _listed(_item("tests/c/test_x.py::test_op[jax]", backend="jax"), table)  # another file
    assert _listed(_item("tests/b/test_y.py::test_long_one[3]"), table)
    assert not _listed(_item("tests/b/test_y.py::test_short"), table)


@pytest.mark.parametrize("key", sorted({*SLOW, *TIMING}))
def test_every_entry_names_a_test_that_exists(key):
    path, _, name = key.removesuffix("[jax]").partition("::")
    name = name.partition("[")[0]
    tree = ast.parse((ROOT / path).read_text())
    tests = [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("test")]
    if not name:  # path[jax]: a module whose tests take a backend
        assert any("backend" in {a.arg for a in n.args.args} for n in ast.walk(tree)
                   if isinstance(n, ast.FunctionDef) and n.name in tests), key
    else:
        assert any(t.startswith(name) for t in tests), f"{key}: no test {name}* in {path}"


PROBE = '''
import pytest

@pytest.mark.mpi
def test_launches():
    pass

@pytest.mark.timing
def test_times():
    pass

def test_quick():
    pass
'''


def _child(path, *args):
    env = {k: v for k, v in os.environ.items() if k != "MINIDIST_REQUIRE_MPI"}
    env["PYTHONPATH"] = str(ROOT)
    # the repository's pyproject (its addopts) applies: rootdir is ROOT, the probe a path inside tmp
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
           "--rootdir", str(ROOT), "-c", str(ROOT / "pyproject.toml"), *args, str(path)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT).stdout


def _passed(out):
    """The probe's tests that passed (``-rA``'s summary lines), by name: a run in xdist workers
    does not count what it deselected."""
    return sorted(line.split("::")[-1].split()[0] for line in out.splitlines()
                  if line.startswith("PASSED ") and "::" in line)


def test_the_default_command_leaves_out_mpi_and_timing_tests_and_m_slow_runs_just_them(tmp_path):
    """A folder: the slow set left out (in xdist workers), or alone with ``-m slow`` (in this process,
    no workers); a file named: all of it, in this process."""
    (tmp_path / "test_probe.py").write_text(PROBE)
    out = _child(tmp_path, "-rA")
    assert _passed(out) == ["test_quick"], out
    assert "bringing up nodes" in out or "workers" in out, out  # the default set is distributed
    out = _child(tmp_path, "-m", "slow")  # test_quick alone is left out (the mpi one skips without mpirun)
    assert "2 passed, 1 deselected" in out or "1 passed, 1 skipped, 1 deselected" in out, out
    assert "bringing up nodes" not in out, out
    out = _child(tmp_path / "test_probe.py")  # a file named: all of it
    assert "3 passed" in out or "2 passed, 1 skipped" in out, out
    assert "bringing up nodes" not in out, out
