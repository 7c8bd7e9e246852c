"""Optional tracing hook: wrap communication in spans when ``minidist.trace`` has a tracer active.

Costs one function call and an attribute check when tracing is off (the common case).
"""

from __future__ import annotations

import contextlib

NULL = contextlib.nullcontext()  # what span() returns when tracing is off

_trace = None  # the minidist.trace module, imported on first use (it may not exist)
_looked = False


def span(name: str, cat: str):
    """A context manager recording ``name`` (category ``cat``) on the current rank's tracer, if any."""
    global _trace, _looked
    if not _looked:
        try:
            from minidist import trace as _trace
        except ImportError:
            _trace = None
        _looked = True
    if _trace is None:
        return NULL
    tracer = _trace.current()
    return NULL if tracer is None else tracer.span(name, cat)
