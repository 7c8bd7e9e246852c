"""Emulated imbalance (``minidist.resilience.stragglers``: a slowed rank or layer) and measuring it:
the monitor's agreed, median-smoothed table and the straggler detector."""

import time

import numpy as np
import pytest

from minidist.comm import run
from minidist.parallel.balance import (
    StepMonitor,
    StragglerDetector,
)
from minidist.resilience.stragglers import Slow, Slowdown, parse
from tests.parallel.balance.helpers import virtual_clock

# -- emulated imbalance --------------------------------------------------------------------------

def test_slow_spec_parses_and_rejects_with_a_reason():
    assert parse("rank=2,factor=3,from_step=5") == [Slow(factor=3.0, rank=2, from_step=5)]
    assert parse(" layer=1,factor=4 ; rank=0,factor=2") == [Slow(factor=4.0, layer=1),
                                                             Slow(factor=2.0, rank=0)]
    s = Slowdown("rank=2,factor=3,from_step=5")
    assert [s.rank_factor(2, k) for k in (4, 5, 9)] == [1.0, 3.0, 3.0] and s.rank_factor(1, 9) == 1.0
    for bad, why in [("rank=2", "factor"), ("factor=3", "exactly one"),
                     ("rank=1,layer=2,factor=2", "exactly one"), ("rank=1,factor=0.5", "F >= 1"),
                     ("rank=x,factor=2", "not a number"),
                     ("speed=2", "bad item")]:
        with pytest.raises(ValueError, match=why):
            parse(bad)
    with pytest.raises(ValueError, match="slows rank 5, but there are only 4 ranks"):
        Slowdown("rank=5,factor=2").check_world(4)


def test_slowdown_stretches_the_measured_work_by_its_factor(monkeypatch):
    s = Slowdown("rank=0,factor=3,from_step=1", pace=0.004)
    for step, want in [(0, 0.04), (1, 0.12)]:  # 10 rows x 4 ms paced, x3 from step 1
        t0 = time.perf_counter()
        with s.compute(0, step, rows=10):
            pass
        took = time.perf_counter() - t0
        assert took >= want, (step, took)  # a loaded machine only adds time: no upper bound on a real clock
    clock = virtual_clock(monkeypatch)  # exact: factor x max(real work, rows x pace)
    for step, work, want in [(0, 0.0, 0.04), (1, 0.0, 0.12), (1, 0.05, 0.15), (0, 0.05, 0.05)]:
        t0 = clock.perf_counter()
        with s.compute(0, step, rows=10):
            clock.sleep(work)  # real work that outlasts the pace counts instead of it
        assert clock.perf_counter() - t0 == pytest.approx(want), (step, work)


# -- measuring -----------------------------------------------------------------------------------

def test_monitor_agrees_on_every_rank_and_smooths_by_median():
    def body(comm):
        mon = StepMonitor(comm, window=3)
        for k, c in enumerate([1.0, 100.0, 2.0, 3.0]):  # one outlier step
            table = mon.record(c * (comm.rank + 1), 0.5 * k, 2 * (comm.rank + 1))
        return table, mon.smoothed("compute"), mon.seconds_per_row()
    results = run(body, ranks=3)
    want = np.array([[3.0 * (r + 1), 1.5, 2 * (r + 1)] for r in range(3)])  # the last step's numbers
    for table, smooth, spr in results:
        np.testing.assert_array_equal(table, want)
        # the window holds the last 3 steps: compute (100, 2, 3) x (r+1) -> median 3 (r+1), not the 100
        np.testing.assert_array_equal(smooth, [3.0 * (r + 1) for r in range(3)])
        np.testing.assert_allclose(spr, [1.5] * 3)  # per row: (50, 1, 1.5) -> 1.5 on every rank


def test_straggler_is_named_after_patience_steps_and_not_for_noise():
    det = StragglerDetector(threshold=0.5, patience=2)
    assert det.update(0, [1.0, 1.1, 3.0, 0.9]) == []        # once is not enough
    assert det.update(1, [1.0, 1.0, 1.2, 1.0]) == []        # 20% slower: noise
    assert det.update(2, [1.0, 1.0, 3.0, 1.0]) == []
    assert det.update(3, [1.0, 1.0, 3.0, 1.0]) == [2]
    assert det.events == [(3, 2, 3.0)]


def test_straggler_threshold_is_strict_and_each_episode_is_one_event():
    """Slow means more than (1 + threshold) x the median: with threshold 0.5 and a median of 2.0 a rank at
    exactly 3.0 is not slow (binary-exact numbers), one at 3.5 is. A rank slow for 4 updates in a row is
    named from the 2nd (patience 2) and recorded once; once it recovers, a new episode is a new event."""
    det = StragglerDetector(threshold=0.5, patience=2)
    for step in range(3):
        assert det.update(step, [2.0, 2.0, 3.0]) == []
    assert det.count[2] == 0
    named = [det.update(step, [2.0, 2.0, 3.5]) for step in range(3, 7)]
    assert named == [[], [2], [2], [2]]
    assert det.events == [(4, 2, 1.75)]
    assert det.update(7, [2.0, 2.0, 2.0]) == []
    assert [det.update(s, [2.0, 2.0, 4.0]) for s in (8, 9, 10)] == [[], [2], [2]]
    assert det.events == [(4, 2, 1.75), (9, 2, 2.0)]


def test_seconds_per_row_is_the_median_over_exactly_the_last_window_steps():
    """window=2 over steps whose per-row times are 10, 1, 3 (rank 0) and 4, 2, 6 (rank 1): the median of
    the last two, (1+3)/2 = 2 and (2+6)/2 = 4; the step before the window does not count."""
    def body(comm):
        mon = StepMonitor(comm, window=2)
        per_row = [[10.0, 4.0], [1.0, 2.0], [3.0, 6.0]]
        for t in per_row:
            mon.record(t[comm.rank] * 4, 0.0, 4)
        return mon.seconds_per_row(), mon.smoothed("compute")
    for spr, smooth in run(body, ranks=2):
        np.testing.assert_array_equal(spr, [2.0, 4.0])
        np.testing.assert_array_equal(smooth, [8.0, 16.0])
