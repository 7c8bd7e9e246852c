"""The load-balancing lesson: on threads (virtual clock), with a broken twin (exit 1), under mpirun."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.parallel.balance.helpers import ROOT, virtual_clock

# -- the lesson: threads, a broken twin, mpirun ------------------------------------------------------

SMALL = ["--steps", "8", "--pp-steps", "4", "--pace", "0.004", "--batch", "12", "--microbatches", "4",
         "--slow", "rank=1,factor=3,from_step=2"]


def test_lesson_detects_moves_and_passes_on_threads(monkeypatch, capsys):
    """On the virtual clock (what moves depends only on the emulated times, not the machine's load):
    rank 1 is named 3x slower, the shares move, the pipeline is re-cut, both twins PASS."""
    from minidist.lessons.load_balancing import main
    from minidist.parallel.balance import dp, pipeline, profile

    virtual_clock(monkeypatch, dp, pipeline, profile)
    main(["--ranks", "3", *SMALL])
    out = capsys.readouterr().out
    assert "detected: rank 1 is 3.0x slower per row" in out and "shares moved after step" in out
    assert "re-partitioned after step" in out and out.count("-> PASS") == 2 and "FAIL" not in out
    assert re.search(r"balanced time B / sum\(s_i\) = [\d.]+ ms: .* (MET|MISSED)", out)


def test_lesson_exits_1_when_its_serial_twin_disagrees(monkeypatch, capsys):
    from minidist.lessons import load_balancing as lesson

    real = lesson.train_serial

    def skewed(*a, **k):
        state, losses = real(*a, **k)
        return {n: v * 1.1 for n, v in state.items()}, losses
    monkeypatch.setattr(lesson, "train_serial", skewed)
    with pytest.raises(SystemExit) as info:
        lesson.main(["--ranks", "2", *SMALL[:-2], "--pp-steps", "2"])
    assert info.value.code == 1 and "FAIL" in capsys.readouterr().out


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun (pip install mpich)")
def test_lesson_under_mpirun_4():
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("MINIDIST_TRANSPORT", None)
    cmd = ["mpirun", "-n", "4", sys.executable, "-m", "minidist.lessons.load_balancing", *SMALL]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "data parallelism on 4 ranks" in res.stdout and res.stdout.count("-> PASS") == 2
    # real clocks: whether a re-cut pays for itself depends on the load; the lesson says which it did
    assert "re-partitioned after step" in res.stdout or "no re-partition paid for itself" in res.stdout
