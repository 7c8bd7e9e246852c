"""What time it is on this rank: the wall clock, or -- under the virtual clock -- the rank's own.

``now()`` is what timelines, step times, TTFT/TPOT and straggler detection read: seconds on a time
line every rank of one run shares. The virtual clock (``minidist.comm.clock``) registers each
rank's time source for the threads that act for it (``use``); without one, ``now()`` is wall time,
so the benchmarks against PyTorch and MPI keep measuring the machine.
"""

from __future__ import annotations

import threading
import time

_local = threading.local()  # .source: this thread's rank's clock (a function), when one runs


def now() -> float:
    """Seconds on this rank: its virtual time, or wall time (``time.time()``)."""
    source = getattr(_local, "source", None)
    return time.time() if source is None else source()


def use(source):
    """Read ``source()`` for ``now()`` in this thread (None: the wall clock again); returns the
    previous source."""
    previous = getattr(_local, "source", None)
    _local.source = source
    return previous


def is_virtual() -> bool:
    """Does this thread read a virtual clock?"""
    return getattr(_local, "source", None) is not None
