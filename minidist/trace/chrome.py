"""Every rank's spans in one file: gathered on rank 0, written as a Chrome trace (open it in Perfetto).

A job restarted after a failure runs as several attempts, and a killed attempt never reaches the end
where traces are gathered. So each rank can append its spans to a part file as it goes
(``append_part``, one JSON object a line), and the last attempt merges every part (``read_parts``)
into one trace: an event that carries an ``"attempt"`` is drawn in that attempt's process.
"""

from __future__ import annotations

import json
import os

from minidist.trace.timeline import _t_origin


def gather_events(comm, tracer) -> list[dict] | None:
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
