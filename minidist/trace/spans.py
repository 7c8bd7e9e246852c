"""The tracing seam: the active tracer of this rank, and ``span`` -- the one line code needs to show up
on the timeline.

``with span("forward mb 3"):`` records an interval on this rank's tracer (``tracer.Tracer``) when
one is active, and costs one flag check when none ever was. The active tracer is thread-local
because the threads transport runs its ranks as threads of one process. Algorithms import this
file only; recording, gathering and drawing live beside it in ``minidist.trace``. ``now``,
``sleep`` and ``arrival`` are the rank's clock (``trace.clock``: virtual under ``MINIDIST_CLOCK=virtual``).
"""

from __future__ import annotations

import contextlib
import threading
from contextlib import contextmanager

from minidist.trace.clock import arrival, now, sleep  # noqa: F401 - the rank's clock (step times, TTFT)

CATEGORIES = ("compute", "send", "recv", "wait", "collective", "step")

_local = threading.local()


def current():
    """This thread's active tracer, or None when tracing is off."""
    return getattr(_local, "tracer", None)


ever_set = False  # has any thread had a tracer? Until then a collective skips the thread-local lookup


def set_current(tracer) -> None:
    """Make `tracer` the active tracer of this thread (None turns tracing off)."""
    global ever_set
    if tracer is not None:
        ever_set = True
    _local.tracer = tracer


@contextmanager
def tracing(tracer):
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
