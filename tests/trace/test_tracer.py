"""Recording spans (``minidist.trace.tracer``, used through ``minidist.trace``): intervals, args,
categories, and the tracer that is current per thread."""

import threading
import time

import pytest

from minidist import trace


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
