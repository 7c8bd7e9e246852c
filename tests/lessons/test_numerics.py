"""The numerics lab: its table, its outlier experiment and its exit status (MET -> 0, MISSED -> 1)."""

import re

import numpy as np
import pytest

from minidist.lessons import numerics

SMALL = ["--ranks", "2", "--steps", "4", "--seq", "8", "--dim", "32", "--layers", "1", "--batch", "2",
         "--block", "8"]


def test_the_lab_prints_every_run_and_meets_its_target(capsys, tmp_path):
    plot = tmp_path / "loss.png"
    numerics.main(SMALL + ["--plot", str(plot)])
    out = capsys.readouterr().out
    for run in numerics.RUNS:
        assert re.search(rf"^{re.escape(run)}\s+\d\.\d{{5}}\s+[+-]\d", out, re.M), run
    assert "serial twin" in out and "PASS" in out and "MET" in out and "FAIL" not in out
    assert plot.stat().st_size > 0


def test_a_target_no_run_can_meet_exits_1(capsys, monkeypatch):
    monkeypatch.setattr(numerics, "TARGET", -1.0)  # |gap| <= -1 · bf16 is impossible
    with pytest.raises(SystemExit) as info:
        numerics.main(SMALL)
    assert info.value.code == 1
    assert "MISSED" in capsys.readouterr().out


def test_the_outlier_flushes_per_tensor_and_spares_block_scaling():
    """The experiment's numbers from outside: with a 1e5 x amax outlier in row 0, e4m3's 18 binades
    below the scaled outlier leave nothing of values 1e5 times smaller (per-tensor), while every
    tile but the outlier's keeps its own scale (block)."""
    x = np.random.default_rng(0).standard_normal((4, 32)).astype(np.float32)
    rows = {(s, w): (f, e, o) for s, w, f, e, o in numerics.outlier_experiment(x, block=8)}
    assert rows[("current", "outlier step")][0] > 0.5
    assert rows[("block", "outlier step")][0] == 0 and rows[("block", "outlier step")][1] < 2 ** -4
    assert rows[("delayed", "outlier step")][2] > 0.99  # saturated at 448 · s, far below the outlier
    assert rows[("delayed", "next step")][0] > 0.5  # the window still holds the outlier's amax


def test_the_lab_exits_1_when_its_serial_twin_disagrees(capsys, monkeypatch):
    real = numerics.train_serial

    def skewed(*a, **k):  # a serial twin whose losses are off by 10%
        state, losses = real(*a, **k)
        return state, [x * 1.1 for x in losses]
    monkeypatch.setattr(numerics, "train_serial", skewed)
    with pytest.raises(SystemExit) as info:
        numerics.main(SMALL)
    assert info.value.code == 1
    assert "FAIL" in capsys.readouterr().out
