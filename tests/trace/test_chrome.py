"""Per-rank tracing (``minidist.trace``): gathering every rank's spans, the Chrome trace (one track per
rank; one process per attempt of a restarted job) and its part files."""

import json

from hypothesis import given
from hypothesis import strategies as st

from minidist import trace
from minidist.parallel.pipeline.schedule import one_f_one_b
from minidist.parallel.pipeline.simulate import simulate
from tests.conftest import budget


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


@budget(10)
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


def test_parts_of_two_attempts_merge_into_one_trace_one_process_each(tmp_path):
    """Each attempt's spans, appended to its part file, come back in start order; a last line cut short
    (a process killed while writing it) is dropped; in the Chrome trace each attempt is a process."""
    a0 = trace.Tracer(0)
    a0.add("step 1", "step", 10.0, 11.0, step=1)
    a0.add("step 2", "step", 11.0, 12.0, step=2)
    a1 = trace.Tracer(1)
    a1.add("step 2", "step", 20.0, 21.5, step=2)
    p0, p1 = tmp_path / "attempt-0-rank-0.jsonl", tmp_path / "attempt-1-rank-1.jsonl"
    trace.append_part(p0, a0.events[:1], attempt=0)
    trace.append_part(p0, a0.events[1:], attempt=0)
    trace.append_part(p1, a1.events, attempt=1)
    with open(p0, "a") as f:
        f.write('{"name": "step 3", "cat": "st')  # killed mid-line
    events = trace.read_parts([p1, p0, tmp_path / "missing.jsonl"])
    assert [(e["attempt"], e["rank"], e["name"]) for e in events] == [(0, 0, "step 1"), (0, 0, "step 2"),
                                                                        (1, 1, "step 2")]
    out = trace.chrome_trace(events)["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in out if e["name"] == "process_name"}
    assert procs == {0: "attempt 0", 1: "attempt 1"}
    spans = [(e["pid"], e["tid"], e["ts"], e["dur"]) for e in out if e["ph"] == "X"]
    assert spans == [(0, 0, 0.0, 1e6), (0, 0, 1e6, 1e6), (1, 1, 10e6, 1.5e6)]  # microseconds from t=10 s


def test_chrome_trace_without_attempts_is_one_process():
    t = trace.Tracer(2)
    t.add("F", "compute", 1.0, 2.0)
    out = trace.chrome_trace(t.events)["traceEvents"]
    assert [e["args"]["name"] for e in out if e["name"] == "process_name"] == ["minidist"]
    assert {e["pid"] for e in out} == {0}
