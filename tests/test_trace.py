"""Per-rank tracing: spans, thread-local current tracer, gathering, Chrome trace, ASCII, plot."""

import json
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minidist import trace
from minidist.parallel.schedule import one_f_one_b
from minidist.parallel.simulate import simulate


def test_span_records_interval_with_args_and_category():
    t = trace.Tracer(rank=3)
    before = time.time()
    with t.span("F", "compute", mb=2) as args:
        time.sleep(0.01)
        args["bytes"] = 8
    t.instant("step done")
    (e, i) = t.events
    assert e["name"] == "F" and e["cat"] == "compute" and e["rank"] == 3
    assert e["args"] == {"mb": 2, "bytes": 8}
    assert before - 0.01 <= e["t0"] < e["t1"] and e["t1"] - e["t0"] >= 0.009
    assert i["t0"] == i["t1"] >= e["t1"] and i["cat"] == "step"


def test_span_records_even_when_the_body_raises():
    t = trace.Tracer(0)
    with pytest.raises(KeyError), t.span("Backward", "compute"):
        raise KeyError("boom")
    assert [e["name"] for e in t.events] == ["Backward"]


def test_bad_category_and_rank_raise():
    with pytest.raises(ValueError, match="unknown trace category 'gpu'"):
        with trace.Tracer(0).span("x", "gpu"):
            pass
    with pytest.raises(ValueError, match="rank must be an int >= 0"):
        trace.Tracer(-1)


def test_current_tracer_is_per_thread():
    seen = {}

    def rank_main(r):
        assert trace.current() is None
        with trace.tracing(trace.Tracer(r)):
            time.sleep(0.01)
            seen[r] = trace.current().rank
        assert trace.current() is None

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert seen == {0: 0, 1: 1, 2: 2, 3: 3}
    assert trace.current() is None
    trace.set_current(trace.Tracer(9))
    assert trace.current().rank == 9
    trace.set_current(None)


class _FakeComm:
    """Stands in for a Communicator's gather_obj: rank 0 receives every rank's object."""

    def __init__(self, rank, everyone):
        self.rank, self.everyone = rank, everyone

    def gather_obj(self, obj, root=0):
        return self.everyone if self.rank == root else None


def test_gather_events_sorts_all_ranks_on_root_only():
    tracers = [trace.Tracer(r) for r in range(3)]
    for r in (2, 0, 1):
        with tracers[r].span("F", mb=r):
            pass
    everyone = [t.events for t in tracers]
    events = trace.gather_events(_FakeComm(0, everyone), tracers[0])
    assert [e["rank"] for e in events] == [2, 0, 1]
    assert trace.gather_events(_FakeComm(1, everyone), tracers[1]) is None


@settings(max_examples=10, deadline=None, derandomize=True)
@given(st.integers(1, 8), st.integers(1, 8))
def test_chrome_trace_is_valid_json_with_one_track_per_rank(tmp_path_factory, p, m):
    events = simulate(one_f_one_b(p, m)).events
    path = tmp_path_factory.mktemp("trace") / "t.json"
    trace.write_chrome_trace(path, events)
    doc = json.loads(path.read_text())
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert names == {r: f"rank {r}" for r in range(p)}
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(events)
    assert all(e["pid"] == 0 and e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    assert {e["tid"] for e in spans} == set(range(p))


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


def test_plot_timeline_writes_a_png(tmp_path):
    path = tmp_path / "timeline.png"
    trace.plot_timeline(path, simulate(one_f_one_b(3, 4)).events, losses=[3.0, 2.5, 2.1])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
