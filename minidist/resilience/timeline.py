"""A restarted job's timeline: every attempt's spans in one Chrome trace, and its attempts drawn.

A killed attempt never reaches the end of the job, where a trace is usually gathered. So with
``AttemptTrace`` each rank traces into its own part file, ``PATH.parts/attempt-A-rank-R.jsonl``,
appending its spans after every step (``flush``; ``minidist.trace.append_part``): what a rank did
before it was killed is on disk. At the end, the last attempt calls ``merge_attempts(PATH)``,
which writes every part of every attempt into the one Chrome trace ``PATH`` -- one process per
attempt, one track per rank, on one time axis (``minidist.trace.chrome_trace``) -- and removes the
parts. ``plot_attempts`` draws the supervisor's event log: attempts as rows, steps, saves, the
failure and the restore.
"""

from __future__ import annotations

import glob
import os
import shutil

from minidist.trace.chrome import append_part, read_parts, write_chrome_trace
from minidist.trace.spans import set_current
from minidist.trace.tracer import Tracer


def parts_dir(path) -> str:
    """The folder of the part files of the trace ``path``."""
    return f"{path}.parts"


class AttemptTrace:
    """This rank's tracer for one attempt, flushed to its part file: ``flush()`` after every step."""

    def __init__(self, path, rank: int, attempt: int):
        os.makedirs(parts_dir(path), exist_ok=True)
        self.part = os.path.join(parts_dir(path), f"attempt-{attempt}-rank-{rank}.jsonl")
        self.attempt = attempt
        self.tracer = Tracer(rank)
        set_current(self.tracer)

    @staticmethod
    def clear(path) -> None:
        """Forget the parts of an earlier run (a fresh job, attempt 0, calls it before tracing)."""
        shutil.rmtree(parts_dir(path), ignore_errors=True)

    def flush(self) -> None:
        """Append the spans recorded since the last flush to the part file, tagged with the attempt."""
        append_part(self.part, self.tracer.events, attempt=self.attempt)
        self.tracer.events.clear()

    def stop(self) -> None:
        """Flush what is left and stop tracing on this thread."""
        self.flush()
        set_current(None)


def merge_attempts(path) -> list[dict]:
    """Write every attempt's parts into the Chrome trace ``path``, remove the parts; the events."""
    events = read_parts(sorted(glob.glob(os.path.join(parts_dir(path), "attempt-*-rank-*.jsonl"))))
    write_chrome_trace(path, events)
    shutil.rmtree(parts_dir(path), ignore_errors=True)
    return events


def plot_attempts(path, events):
    """Attempts as rows: step bars, saves as ticks, the failure as a red cross, restores in green."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    t0 = min(e["t"] for e in events) if events else 0.0
    fig = Figure(figsize=(10, 2.5))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for e in events:
        a = e.get("attempt", 0)
        if e["event"] == "step":
            ax.broken_barh([(e["t0"] - t0, e["t1"] - e["t0"])], (a - 0.3, 0.6), facecolors="#4c72b0")
        elif e["event"] == "save":
            ax.plot([e["t"] - t0], [a + 0.4], "k|")
        elif e["event"] == "failure":
            ax.plot([e["t"] - t0], [a], "rx", markersize=12)
        elif e["event"] == "restore" and e.get("step") is not None:
            ax.plot([e["t"] - t0], [a], "g>", markersize=9)
    if not events:  # no supervisor, so no attempts were recorded: say so instead of an empty frame
        ax.text(0.5, 0.5, "no supervised attempts to draw: run under\npython -m minidist.launch -n 4 -- "
                "python -m minidist.lessons.fault_tolerance --plot FILE.png", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_xlabel("wall time since the first event (s)")
    ax.set_yticks(sorted({e.get("attempt", 0) for e in events}))
    ax.set_ylabel("attempt (restart)")
    ax.invert_yaxis()
    ax.set_title("steps (blue), saves (|), failure (x), restore from checkpoint (>)", loc="right", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
