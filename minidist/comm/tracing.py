"""Optional tracing hook: wrap communication in spans when ``minidist.trace`` has a tracer active.

Costs one function call and an attribute check when tracing is off (the common case).
"""

from __future__ import annotations

import contextlib

from minidist.trace import spans as _trace

NULL = contextlib.nullcontext()  # what span() returns when tracing is off


def span(name: str, cat: str):
    """A context manager recording ``name`` (category ``cat``) on the current rank's tracer, if any."""
    if not _trace.ever_set:  # tracing never turned on in this process: nothing to look up
        return NULL
    tracer = getattr(_trace._local, "tracer", None)  # (trace.current(), inlined: every call asks)
    return NULL if tracer is None else tracer.span(name, cat)
