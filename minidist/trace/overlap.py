"""Communication overlapping backward: the timeline of one gradient-sync window of data parallelism.

`OverlapRecorder` times the syncing backward and each collective where it really ran (on the
communicator's async worker); `hidden_fraction` says how much of the communication the backward
hid. `minidist.trace` re-exports both.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

from minidist.trace.spans import current


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
