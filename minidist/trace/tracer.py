"""A rank's ``Tracer``: the spans it recorded, as plain dicts, and per-layer forward spans.

A span is ``{"name", "cat", "rank", "t0", "t1", "args"}``: times in seconds since the Unix epoch,
with ``perf_counter`` precision inside a rank, so spans of ranks in different processes on one host
line up. The pipeline simulator produces the same dicts in model time, so every drawing function
serves measured and simulated runs alike.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

from minidist.trace import clock
from minidist.trace.spans import CATEGORIES, current


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
        """Seconds since the Unix epoch, with perf_counter precision; under the virtual clock, the
        rank's virtual seconds (``trace.clock``)."""
        if clock.is_virtual():
            return clock.now()
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
