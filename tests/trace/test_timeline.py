"""Reading spans (``minidist.trace.timeline``, used through ``minidist.trace``): the bubble fraction
against the pipeline formula, its median over steps, and the ASCII and drawn timelines."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist import trace
from minidist.parallel.pipeline.schedule import one_f_one_b
from minidist.parallel.pipeline.simulate import simulate
from tests.conftest import budget


def test_measured_events_draw_and_bubble():
    tracers = [trace.Tracer(r) for r in range(2)]
    t0 = tracers[0].now()
    tracers[0].add("Forward", "compute", t0, t0 + 0.1, mb=0)
    tracers[0].add("RecvGrad", "recv", t0 + 0.1, t0 + 0.2, mb=0)
    tracers[1].add("Forward", "compute", t0 + 0.1, t0 + 0.2, mb=0)
    events = tracers[0].events + tracers[1].events
    assert trace.bubble_fraction(events) == pytest.approx(0.5)
    rows = trace.ascii_timeline_from_events(events, width=10).splitlines()
    assert rows == ["rank 0 |F0fff.....|", "rank 1 |.....F0fff|"]


def per_rank_steps(runs, p):
    """Simulated steps, one after another in time, as ``steps_per_rank[r][s]`` (what ranks gather)."""
    out, t = [[] for _ in range(p)], 0.0
    for events in runs:
        for r in range(p):
            out[r].append([dict(e, t0=e["t0"] + t, t1=e["t1"] + t) for e in events if e["rank"] == r])
        t += max(e["t1"] for e in events) + 5.0  # a gap between steps is nobody's bubble
    return out


@budget(15)
@given(p=st.integers(1, 4), m=st.integers(1, 6), n=st.integers(1, 4))
def test_median_bubble_skips_the_warm_up_step_and_matches_the_formula(p, m, n):
    """A warm-up step of m = 1 (bubble (p-1)/p), then n steps of m microbatches: skipping it gives
    the 1F1B formula (p-1)/(m+p-1); forward/backward are the work, the optimizer step is not."""
    def bubble(p, m):  # the textbook formula, written out
        return (p - 1) / (m + p - 1)

    runs = [simulate(one_f_one_b(p, 1)).events] + [simulate(one_f_one_b(p, m)).events] * n
    steps = per_rank_steps(runs, p)
    assert trace.median_bubble(steps) == pytest.approx(bubble(p, m), abs=1e-12)
    assert trace.median_bubble(steps, skip=n + 5) == pytest.approx(bubble(p, m), abs=1e-12)
    if n == 1:  # two steps, none skipped: the median is their mean
        want = (bubble(p, 1) + bubble(p, m)) / 2
        assert trace.median_bubble(steps, skip=0) == pytest.approx(want, abs=1e-12)


def test_median_bubble_counts_only_the_named_events_and_takes_the_median():
    def step(t, busy0, busy1, opt=0.0):  # in [t, t+1]: rank 0 busy0 then opt, rank 1 busy1 at the end
        return [[{"name": "Forward", "cat": "compute", "rank": 0, "t0": t, "t1": t + busy0},
                 {"name": "OptimizerStep", "cat": "compute", "rank": 0, "t0": t + busy0,
                  "t1": t + busy0 + opt}],
                [{"name": "Backward", "cat": "compute", "rank": 1, "t0": t + 1 - busy1, "t1": t + 1}]]
    steps = [step(0, 0.1, 0.1), step(10, 1.0, 0.5), step(20, 0.5, 0.5, opt=0.5), step(30, 0.1, 0.1)]
    per_rank = [[s[r] for s in steps] for r in range(2)]
    assert trace.median_bubble(per_rank) == pytest.approx(0.5)  # of 0.25, 0.5, 0.9
    assert trace.median_bubble(per_rank, names=None) == pytest.approx(0.25)  # of 0.25, 0.25, 0.9
    assert trace.median_bubble(per_rank, skip=0) == pytest.approx((0.5 + 0.9) / 2)  # with the warm-up's 0.9


def test_median_bubble_refuses_ranks_with_different_step_counts():
    step = [{"name": "Forward", "cat": "compute", "rank": 0, "t0": 0.0, "t1": 1.0}]
    with pytest.raises(ValueError, match=r"same number \(>= 1\) of steps from every rank, got \[2, 1\]"):
        trace.median_bubble([[step, step], [step]])
    with pytest.raises(ValueError, match="got 0 steps"):
        trace.median_bubble([[], []])


def test_plot_timeline_draws_one_bar_per_event(tmp_path, monkeypatch):
    """The figure itself (caught as it is saved): per rank, one bar per event (step spans left out)
    at that event's start and length, compute on the upper band of the rank's row, communication
    below it, backward darker than forward; and the loss curve."""
    from matplotlib.figure import Figure

    figures = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **kw: (figures.append(fig), save(fig, *a, **kw)))
    events = [dict(e, t0=e["t0"] + 100.0, t1=e["t1"] + 100.0) for e in simulate(one_f_one_b(3, 4)).events]
    events.append({"name": "step", "cat": "step", "rank": 0, "t0": 100.0, "t1": 120.0, "args": {}})
    path = tmp_path / "timeline.png"
    trace.plot_timeline(path, events, losses=[3.0, 2.5, 2.1])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = figures
    timeline, loss_axes = fig.axes
    bars = []  # (rank, band, x0, width, color) of every rectangle drawn
    for coll in timeline.collections:
        for path_, color in zip(coll.get_paths(), coll.get_facecolors()):
            (x0, y0), (x1, y1) = path_.vertices.min(axis=0), path_.vertices.max(axis=0)
            rank = round((y0 + y1) / 2)  # a rank's row is centred on its index
            bars.append((rank, "compute" if (y0 + y1) / 2 < rank else "comm", x0, x1 - x0, tuple(color)))
    for r in range(3):
        mine = [e for e in events if e["rank"] == r and e["cat"] != "step"]
        drawn = [b for b in bars if b[0] == r]
        assert len(drawn) == len(mine), f"rank {r}: {len(drawn)} bars for {len(mine)} events"
        want = sorted(("compute" if e["cat"] == "compute" else "comm", round(e["t0"] - 100.0, 9),
                       round(e["t1"] - e["t0"], 9)) for e in mine)  # time runs from the first event
        assert sorted((band, round(x0, 9), round(w, 9)) for _, band, x0, w, _ in drawn) == want
    colors = {b[4] for b in bars if b[1] == "compute"}
    assert len(colors) == 2  # forward and backward told apart
    np.testing.assert_array_equal(loss_axes.lines[0].get_ydata(), [3.0, 2.5, 2.1])
