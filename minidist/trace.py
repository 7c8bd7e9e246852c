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
"""

from __future__ import annotations

import contextlib
import json
import statistics
import threading
import time
from contextlib import contextmanager

CATEGORIES = ("compute", "send", "recv", "wait", "collective", "step")

_local = threading.local()


def current() -> Tracer | None:
    """This thread's active tracer, or None when tracing is off."""
    return getattr(_local, "tracer", None)


ever_set = False  # has any thread had a tracer? Until then a collective skips the thread-local lookup


def set_current(tracer: Tracer | None) -> None:
    """Make `tracer` the active tracer of this thread (None turns tracing off)."""
    global ever_set
    if tracer is not None:
        ever_set = True
    _local.tracer = tracer


@contextmanager
def tracing(tracer: Tracer | None):
    """Activate `tracer` for this thread inside a `with` block, restoring the previous one after."""
    previous = current()
    set_current(tracer)
    try:
        yield tracer
    finally:
        set_current(previous)


_OFF = contextlib.nullcontext()


def span(name: str, cat: str = "compute", **args):
    """``current().span(name, cat, **args)`` when this thread traces, else a context that does
    nothing: the one line code needs to show up on the timeline, free when tracing is off."""
    tracer = getattr(_local, "tracer", None) if ever_set else None
    return _OFF if tracer is None else tracer.span(name, cat, **args)


def _check_cat(cat: str) -> None:
    if cat not in CATEGORIES:
        raise ValueError(f"unknown trace category {cat!r}; use one of {CATEGORIES}")


class Tracer:
    """Records one rank's spans (intervals) and instants as event dicts in `self.events`."""

    def __init__(self, rank: int):
        if not isinstance(rank, int) or rank < 0:
            raise ValueError(f"Tracer rank must be an int >= 0, got {rank!r}")
        self.rank = rank
        self.events: list[dict] = []
        self._wall0 = time.time()
        self._perf0 = time.perf_counter()

    def now(self) -> float:
        """Seconds since the Unix epoch, with perf_counter precision."""
        return self._wall0 + (time.perf_counter() - self._perf0)

    def add(self, name: str, cat: str, t0: float, t1: float, **args) -> dict:
        """Record an interval measured elsewhere."""
        _check_cat(cat)
        event = {"name": name, "cat": cat, "rank": self.rank, "t0": t0, "t1": t1, "args": args}
        self.events.append(event)
        return event

    @contextmanager
    def span(self, name: str, cat: str = "compute", **args):
        """Time the body of a `with` block as one event; yields the args dict (add results to it)."""
        _check_cat(cat)
        t0 = self.now()
        try:
            yield args
        finally:
            self.add(name, cat, t0, self.now(), **args)

    def instant(self, name: str, cat: str = "step", **args) -> dict:
        """Record a point in time (an event with t0 == t1)."""
        t = self.now()
        return self.add(name, cat, t, t, **args)


# -- forward spans per layer, through Module's wrapper stack ---------------------------------------

def trace_layers(model, layers=None) -> list:
    """Record a "compute" span for each forward of each of ``layers`` (default: ``model``'s
    top-level layers) while a tracer is active; free when none is. The spans come from a wrapper at
    the outermost ``"trace"`` position of ``Module``'s stack, so they include a ZeRO-3 gather and a
    checkpoint's bookkeeping. Returns the handles (``h.remove()`` for each stops it)."""
    named = [(str(i), m) for i, m in enumerate(model.children())] if layers is None else list(layers)
    handles = []
    for name, layer in named:
        label = f"forward {name} ({type(layer).__name__})"

        def wrapper(module, inner, *args, _label=label, **kwargs):
            tracer = current()
            if tracer is None:
                return inner(*args, **kwargs)
            with tracer.span(_label, "compute"):
                return inner(*args, **kwargs)
        handles.append(layer.register_forward_wrapper(wrapper, "trace", "tracing"))
    return handles


# -- communication overlapping backward (data parallelism) ----------------------------------------

class OverlapRecorder:
    """The timeline of one gradient-sync window of data parallelism: ``(name, kind, t0, t1)`` spans,
    kind "backward" (the syncing backward) or "comm" (each collective, timed where it really ran:
    on the communicator's async worker), plus trace spans when a tracer is active.

    ``DistributedDataParallel`` runs its backward in ``backward(record)`` and its collectives through
    ``timed(fn)``; ``close_window()`` (after the sync) moves the window to ``events``, which
    ``hidden_fraction`` reads."""

    def __init__(self):
        self.events: list[tuple] = []  # the last closed window
        self._window: list[tuple] = []

    @contextmanager
    def backward(self, record: bool = True):
        """Time the body (a backward pass); ``record=False`` traces it but keeps it out of the window."""
        tracer, t0 = current(), time.perf_counter()
        with tracer.span("backward", "compute") if tracer else _nothing():
            yield
        if record:
            self._window.append(("backward", "backward", t0, time.perf_counter()))

    def timed(self, fn):
        """``fn(comm, x, label, **kw)`` that runs collective ``fn(comm, x, **kw)`` and records when it
        ran; the caller's tracer is captured now (the worker thread has none of its own)."""
        tracer, window = current(), self._window

        def run(c, x, label, **kw):
            t0 = time.perf_counter()
            with tracer.span(label, "collective") if tracer else _nothing():
                out = fn(c, x, **kw)
            window.append((label, "comm", t0, time.perf_counter()))
            return out
        run.__name__ = getattr(fn, "__name__", "collective")
        return run

    def close_window(self) -> None:
        self.events, self._window = self._window, []


@contextmanager
def _nothing():
    yield


def hidden_fraction(events) -> float:
    """Share of communication time that ran while backward was computing, from an
    ``OverlapRecorder``'s events (``(name, kind, t0, t1)`` with kind "backward" or "comm")."""
    back = [(t0, t1) for _, kind, t0, t1 in events if kind == "backward"]
    comm = [(t0, t1) for _, kind, t0, t1 in events if kind == "comm"]
    total = sum(t1 - t0 for t0, t1 in comm)
    if total <= 0:
        return 0.0
    hidden = sum(max(0.0, min(t1, b1) - max(t0, b0)) for t0, t1 in comm for b0, b1 in back)
    return hidden / total


def gather_events(comm, tracer: Tracer | None) -> list[dict] | None:
    """Collect every rank's events on rank 0 (sorted by start time); other ranks get None.

    Collective: every rank of `comm` must call it. A rank without a tracer contributes nothing.
    """
    gathered = comm.gather_obj(tracer.events if tracer is not None else [], root=0)
    if gathered is None:
        return None
    return sorted((e for rank_events in gathered for e in rank_events), key=lambda e: (e["t0"], e["rank"]))


def _t_origin(events: list[dict]) -> float:
    return min((e["t0"] for e in events), default=0.0)


def chrome_trace(events: list[dict]) -> dict:
    """The Chrome Trace Event JSON object: pid 0, one track (tid) per rank, times in microseconds."""
    t_origin = _t_origin(events)
    ranks = sorted({e["rank"] for e in events})
    out: list[dict] = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "minidist"}}]
    for r in ranks:
        out.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}})
        out.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": r, "args": {"sort_index": r}})
    for e in events:
        out.append({
            "name": e["name"], "cat": e["cat"], "ph": "X", "pid": 0, "tid": e["rank"],
            "ts": (e["t0"] - t_origin) * 1e6, "dur": (e["t1"] - e["t0"]) * 1e6, "args": e.get("args", {}),
        })
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_chrome_trace(path, events: list[dict]) -> None:
    """Write `events` as a Chrome trace file; open it in https://ui.perfetto.dev or chrome://tracing."""
    with open(path, "w") as f:
        json.dump(chrome_trace(events), f, default=str)


def bubble_fraction(events: list[dict]) -> float:
    """Idle share of the ranks x [first start, last end] rectangle: 1 - compute time / (ranks x span).

    Only "compute" events count as work; sends, receives and waits are idle time. Every rank that
    appears in `events` counts, so give it the events of one training step (or of a whole run).
    """
    if not events:
        raise ValueError("bubble_fraction needs at least one event")
    ranks = {e["rank"] for e in events}
    span = max(e["t1"] for e in events) - _t_origin(events)
    busy = sum(e["t1"] - e["t0"] for e in events if e["cat"] == "compute")
    return 1.0 - busy / (len(ranks) * span) if span > 0 else 0.0


def median_bubble(steps_per_rank: list[list[list[dict]]], skip: int = 1,
                  names: tuple | None = ("Forward", "Backward")) -> float:
    """Median over training steps of the measured bubble (``bubble_fraction``) of all ranks together.

    ``steps_per_rank[r][s]``: rank r's events of step s (what each rank recorded between two
    step marks, gathered on one rank). The first ``skip`` steps are warm-up and left out -- as many
    as leave one step. ``names``: the events that count as the pipeline's work (None: every event);
    forward and backward by default, so an optimizer step or a data-parallel all-reduce is idle.
    The median, because one step slowed by a busy machine must not move the number.
    """
    if not steps_per_rank or any(len(s) != len(steps_per_rank[0]) for s in steps_per_rank):
        counts = [len(s) for s in steps_per_rank]
        raise ValueError(f"median_bubble needs the same number (>= 1) of steps from every rank, got {counts}")
    n = len(steps_per_rank[0])
    if n == 0 or skip < 0:
        raise ValueError(f"median_bubble needs >= 1 step and skip >= 0, got {n} steps, skip={skip}")

    def step_bubble(s):
        return bubble_fraction([e for steps in steps_per_rank for e in steps[s]
                                if names is None or e["name"] in names])
    return statistics.median(step_bubble(s) for s in range(min(skip, n - 1), n))


def _cells(event: dict, width: int) -> str:
    """Characters for one compute op `width` columns wide: 'F3fff' = forward of microbatch 3."""
    letter = (event["name"][:1] or "?").upper()
    mb = event.get("args", {}).get("mb")
    label = letter if mb is None else f"{letter}{mb}"
    if width >= len(label):
        return label + letter.lower() * (width - len(label))
    return letter * width


def ascii_timeline_from_events(events: list[dict], width: int = 100, label: str = "rank") -> str:
    """One row per rank, time left to right over `width` columns.

    A compute op is drawn as its first letter and microbatch ('F3fff', 'B3bbbbbb'; just 'FFF' when
    there is no room for the digits); everything else (send, recv, wait, idle) is '.'.
    """
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    if not events:
        return ""
    t_origin = _t_origin(events)
    span = max(e["t1"] for e in events) - t_origin
    scale = width / span if span > 0 else 0.0
    ranks = sorted({e["rank"] for e in events})
    name_w = len(f"{label} {ranks[-1]}")
    rows = []
    for r in ranks:
        row = ["."] * width
        for e in events:
            if e["rank"] != r or e["cat"] != "compute" or e["t1"] <= e["t0"]:
                continue
            c0 = min(width - 1, round((e["t0"] - t_origin) * scale))
            c1 = min(width, round((e["t1"] - t_origin) * scale))
            if c1 <= c0:  # too short to see at this width: one column if it is free
                if row[c0] == ".":
                    row[c0] = e["name"][:1].upper()
                continue
            row[c0:c1] = _cells(e, c1 - c0)
        rows.append(f"{label} {r}".ljust(name_w) + " |" + "".join(row) + "|")
    return "\n".join(rows)


_COLORS = {"compute": "#4c72b0", "send": "#dd8452", "recv": "#55a868", "wait": "#c44e52",
           "collective": "#8172b3", "step": "#cccccc"}


def plot_timeline(path, events: list[dict], losses=None, title: str = "timeline", labels=None,
                  ms: bool = False) -> None:
    """Draw per-rank bars colored by category (backward ops darker; communication in a thinner band
    below the compute; a compute op's microbatch written inside its bar) and, if given, the loss
    curve. ``labels``: rank -> row label (e.g. "dp 0 · stage 1 · tp 0"; default "rank r");
    ``ms=True``: event times are seconds, drawn in milliseconds.

    Uses matplotlib's Agg canvas directly (no pyplot global state), so it is safe in any thread.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    t_origin = _t_origin(events)
    ranks = sorted({e["rank"] for e in events})
    fig = Figure(figsize=(10, 1.2 + 0.45 * max(1, len(ranks)) + (2.5 if losses is not None else 0)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(2 if losses is not None else 1, 1, squeeze=False,
                        gridspec_kw={"height_ratios": [2, 1]} if losses is not None else None)
    ax = axes[0][0]
    for e in events:
        if e["cat"] == "step":
            continue  # a step span covers everything; it would hide the ops it contains
        color = "#1f3b63" if e["cat"] == "compute" and e["name"].startswith("B") else _COLORS[e["cat"]]
        # compute on the upper part of a rank's row, communication on the lower part: an all-reduce
        # that overlaps backward shows under it instead of hiding it
        band = (e["rank"] - 0.4, 0.5) if e["cat"] == "compute" else (e["rank"] + 0.12, 0.28)
        k = 1e3 if ms else 1.0
        x0, w = (e["t0"] - t_origin) * k, max(e["t1"] - e["t0"], 0.0) * k
        ax.broken_barh([(x0, w)], band, facecolors=color, edgecolors="white", linewidth=0.5)
        mb = e.get("args", {}).get("mb") if e["cat"] == "compute" else None
        if mb is not None:
            ax.text(x0 + w / 2, band[0] + band[1] / 2, str(mb), ha="center", va="center", fontsize=6,
                    color="white", clip_on=True)
    ax.set_yticks(ranks)
    ax.set_yticklabels([(labels or {}).get(r, f"rank {r}") for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("time since the first event (ms)" if ms else "time since the first event (s)")
    ax.set_title(title, loc="right", pad=16)  # above the legend
    kinds = {"compute (backward)" if e["cat"] == "compute" and e["name"].startswith("B") else e["cat"]
             for e in events if e["cat"] != "step"}
    colors = dict(_COLORS, **{"compute (backward)": "#1f3b63"})
    order = ["compute", "compute (backward)", "send", "recv", "wait", "collective"]
    handles = [Patch(color=colors[k], label=k) for k in order if k in kinds]  # only what is drawn
    ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0, 1.0), fontsize=7,
              ncol=max(len(handles), 1), frameon=False)
    if losses is not None:
        lax = axes[1][0]
        lax.plot(range(len(losses)), list(losses), marker=".")
        lax.set_xlabel("training step")
        lax.set_ylabel("loss, nats/token")
    fig.tight_layout()
    fig.savefig(path)
