"""The load-balancing lesson: on threads (virtual clock), with a broken twin (exit 1), under mpirun."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.parallel.balance.helpers import ROOT, best_split_time, virtual_clock

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


# -- the lesson under --clock virtual: MET, the same numbers with busy loops beside it ----------------

def _hog(stop):
    while not stop.is_set():
        pass


def _part1_steps(out) -> dict:
    """Part 1's table: step -> (step ms, balanced ms, shares)."""
    rows = re.findall(r"^\s*(\d+)\s+([\d.]+)\s+([\d.]+)\s+(\[[\d, ]+\])", out.split("Part 2")[0], re.M)
    return {int(s): (float(t), float(b), eval(sh)) for s, t, b, sh in rows}


def test_lesson_on_the_virtual_clock_prints_met_under_load(monkeypatch, capsys):
    """``--clock virtual`` (compute in CPU time, the default link): every step of part 1 lasts what a
    hand-worked table says -- the slowest rank's rows x 8 ms (x3 on rank 2 from step 5), plus the
    optimizer step's and the all-reduce's CPU time (< 3 ms); the balanced time is B / sum(s_i) =
    48 / (3/8 + 1/24) = 115.2 ms; the balancer ends at a best whole split (120 ms: 5 rows on rank 2,
    14, 14 and 15 elsewhere), MET; and with two busy loops beside the run every step is the same
    within 2%."""
    import multiprocessing

    from minidist.lessons.load_balancing import main

    for name in ("MINIDIST_CLOCK", "MINIDIST_LINK", "MINIDIST_DEVICE"):
        monkeypatch.setenv(name, "")  # the lesson sets them; restored after the test
    monkeypatch.setenv("MINIDIST_CLOCK", "wall")

    def lesson():
        main(["--ranks", "4", "--clock", "virtual", "--pp-steps", "2"])
        return capsys.readouterr().out

    quiet = lesson()
    stop = multiprocessing.Event()
    hogs = [multiprocessing.Process(target=_hog, args=(stop,)) for _ in range(2)]
    for h in hogs:
        h.start()
    try:
        loaded = lesson()
    finally:
        stop.set()
        for h in hogs:
            h.join()
    pace, want_ideal = 0.008, 48 / (3 / 0.008 + 1 / 0.024)
    assert best_split_time(48, [1 / pace, 1 / pace, 1 / (3 * pace), 1 / pace], 1) == pytest.approx(0.120)
    for out in (quiet, loaded):
        assert "after rebalancing" in out and ": MET" in out and out.count("-> PASS") == 2
        steps = _part1_steps(out)
        assert sorted(steps) == list(range(14))
        for step, (ms, ideal, shares) in steps.items():
            slowest = max(n * pace * (3 if r == 2 and step >= 5 else 1) for r, n in enumerate(shares))
            # + the optimizer step and the all-reduce: a few ms of CPU time beside the paced compute
            # (steps 0 and 1 also pay first calls -- imports, allocations -- in CPU time)
            assert slowest * 1e3 <= ms <= slowest * 1e3 + (3 if step >= 2 else 30), (step, ms, shares)
            if step >= 6:  # the window holds only slowed steps: the speeds the formula assumes
                assert ideal == pytest.approx(want_ideal * 1e3, abs=0.1), (step, ideal)
        final = steps[13][2]  # a best split: 5 slow rows (120 ms) and 43 fast ones, none over 15
        assert final[2] == 5 and sorted(final) == [5, 14, 14, 15], final
    a, b = _part1_steps(quiet), _part1_steps(loaded)
    assert all(abs(a[s][0] - b[s][0]) <= 0.02 * a[s][0] for s in a if s >= 2), (a, b)
