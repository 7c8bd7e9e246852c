"""What time it is on this rank: the wall clock, or -- under the virtual clock -- the rank's own.

``now()`` is what timelines, step times, TTFT/TPOT and straggler detection read: seconds on a time
line every rank of one run shares. The virtual clock (``minidist.comm.clock``) registers each
rank's time source for the threads that act for it (``use``); without one, ``now()`` is wall time,
so the benchmarks against PyTorch and MPI keep measuring the machine. ``sleep(s)`` lets ``s`` pass
on the same clock: an emulated straggler's extra time, a request's arrival -- charged to the virtual
clock without waiting, slept on the wall clock.
"""

from __future__ import annotations

import math
import threading
import time

_local = threading.local()  # .source: this thread's rank's clock (a function), when one runs


def now() -> float:
    """Seconds on this rank: its virtual time, or wall time (``time.time()``)."""
    source = getattr(_local, "source", None)
    return time.time() if source is None else source()


def sleep(seconds: float) -> None:
    """Let ``seconds`` pass on this rank: its virtual clock advanced (nothing waits), or wall time slept."""
    if seconds > 0:
        advance = getattr(_local, "advance", None)
        (time.sleep if advance is None else advance)(seconds)


def arrival(req, clock=None) -> float:
    """When a pending receive's message arrives on this rank's time: on the wall clock (``clock``
    None) now once it is here, else inf; on a virtual ``clock``, its arrival -- waited for in wall time
    with the rank's clock unmoved (``aside``), so the rank takes it once its own time reaches it."""
    if clock is None:
        return now() if req.test() else math.inf
    return clock.aside(req.wait)


def use(source, advance=None):
    """Read ``source()`` for ``now()`` in this thread, ``advance(s)`` for ``sleep(s)`` (None: the wall
    clock again); returns the previous source."""
    previous = getattr(_local, "source", None)
    _local.source, _local.advance = source, advance
    return previous


def current() -> tuple:
    """This thread's (source, advance) as ``use`` set them: what a nested run restores after it."""
    return getattr(_local, "source", None), getattr(_local, "advance", None)


def is_virtual() -> bool:
    """Does this thread read a virtual clock?"""
    return getattr(_local, "source", None) is not None
