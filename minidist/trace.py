"""Per-rank tracing: what each rank did and when, as a Chrome trace, an ASCII timeline or a picture.

Each rank owns a `Tracer` that records intervals ("spans") as plain dicts::

    {"name": "F", "cat": "compute", "rank": 3, "t0": 1732900000.12, "t1": 1732900000.15, "args": {"mb": 2}}

Times are seconds since the Unix epoch: `time.time()` taken once when the tracer is created, plus
`time.perf_counter()` deltas after that, so spans are precise within a rank and comparable across
ranks in different processes on one host. The simulator in `minidist.parallel.pipeline.simulate` produces the
same dicts (in model time units), so every drawing function here serves both measured and simulated runs.

The active tracer is thread-local (`current()` / `set_current()`), because the threads transport
runs its ranks as threads of one process. Code that may trace checks `current() is None` first,
so tracing costs nothing when it is off.

This module is the one to import; it gathers the spans of every rank and writes the Chrome trace.
The rest lives beside it, one idea a file, and is re-exported here: recording
(`minidist/trace_spans.py`), data parallelism's overlap window (`minidist/trace_overlap.py`), and
reading a run -- bubble fraction, ASCII and drawn timelines (`minidist/trace_timeline.py`).

A job restarted after a failure runs as several attempts, and a killed attempt never reaches the end
where traces are gathered. So each rank can append its spans to a part file as it goes
(`append_part`, one JSON object a line), and the last attempt merges every part (`read_parts`)
into one trace: an event that carries an ``"attempt"`` is drawn in that attempt's process.
"""

from __future__ import annotations

import json
import os

from minidist import trace_spans
from minidist.trace_overlap import OverlapRecorder, hidden_fraction
from minidist.trace_spans import CATEGORIES, Tracer, current, set_current, span, trace_layers, tracing
from minidist.trace_timeline import (
    _t_origin,
    ascii_timeline_from_events,
    bubble_fraction,
    median_bubble,
    plot_timeline,
)

__all__ = ["CATEGORIES", "OverlapRecorder", "Tracer", "append_part", "ascii_timeline_from_events",
           "bubble_fraction", "chrome_trace", "current", "gather_events", "hidden_fraction",
           "median_bubble", "plot_timeline", "read_parts", "set_current", "span", "trace_layers",
           "tracing", "write_chrome_trace"]


def gather_events(comm, tracer: Tracer | None) -> list[dict] | None:
    """Collect every rank's events on rank 0 (sorted by start time); other ranks get None.

    Collective: every rank of `comm` must call it. A rank without a tracer contributes nothing.
    """
    gathered = comm.gather_obj(tracer.events if tracer is not None else [], root=0)
    if gathered is None:
        return None
    return sorted((e for rank_events in gathered for e in rank_events), key=lambda e: (e["t0"], e["rank"]))


def chrome_trace(events: list[dict]) -> dict:
    """The Chrome Trace Event JSON object: one track (tid) per rank, times in microseconds.

    Events without an ``"attempt"`` all go in process 0, named "minidist". When events carry one
    (the attempts of a restarted job, merged), each attempt is its own process (pid = the attempt,
    named "attempt N"), so the timeline shows the attempts one above the other on one time axis.
    """
    t_origin = _t_origin(events)
    by_attempt = any("attempt" in e for e in events)
    out: list[dict] = []
    for pid in sorted({e.get("attempt", 0) for e in events} or {0}):
        name = f"attempt {pid}" if by_attempt else "minidist"
        out.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}})
        if by_attempt:
            out.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                        "args": {"sort_index": pid}})
        for r in sorted({e["rank"] for e in events if e.get("attempt", 0) == pid}):
            out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": r,
                        "args": {"name": f"rank {r}"}})
            out.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": r,
                        "args": {"sort_index": r}})
    for e in events:
        out.append({
            "name": e["name"], "cat": e["cat"], "ph": "X", "pid": e.get("attempt", 0), "tid": e["rank"],
            "ts": (e["t0"] - t_origin) * 1e6, "dur": (e["t1"] - e["t0"]) * 1e6, "args": e.get("args", {}),
        })
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_chrome_trace(path, events: list[dict]) -> None:
    """Write `events` as a Chrome trace file; open it in https://ui.perfetto.dev or chrome://tracing."""
    with open(path, "w") as f:
        json.dump(chrome_trace(events), f, default=str)


def append_part(path, events: list[dict], **fields) -> None:
    """Append ``events`` (each updated with ``fields``, e.g. ``attempt=1``) to the part file ``path``,
    one JSON object a line, flushed: what is written survives the process being killed later."""
    with open(path, "a") as f:
        for e in events:
            f.write(json.dumps({**e, **fields}, default=str) + "\n")
        f.flush()


def read_parts(paths) -> list[dict]:
    """Every event of the part files ``paths``, sorted by start time. A last line cut short (its
    process was killed while writing it) is left out; the lines before it are whole."""
    events = []
    for path in paths:
        if not os.path.exists(path):
            continue
        for line in open(path):
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return sorted(events, key=lambda e: (e["t0"], e.get("attempt", 0), e["rank"]))


def __getattr__(name):
    """``trace.ever_set`` and ``trace._local`` read the live state of `minidist.trace_spans` (a copy
    imported here would go stale when the first tracer is set)."""
    if name in ("ever_set", "_local"):
        return getattr(trace_spans, name)
    raise AttributeError(f"module 'minidist.trace' has no attribute {name!r}")
