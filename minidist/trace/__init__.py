"""Per-rank tracing: what each rank did and when, as a Chrome trace, an ASCII timeline or a picture.

One idea a file: the seam algorithms call (spans.py: ``span``, the active tracer), a rank's
``Tracer`` (tracer.py), data parallelism's overlap window (overlap.py), reading a run -- bubble
fraction, ASCII and drawn timelines (timeline.py) -- and the Chrome trace of every rank (chrome.py).
"""

from minidist.trace.chrome import append_part, chrome_trace, gather_events, read_parts, write_chrome_trace
from minidist.trace.overlap import hidden_fraction
from minidist.trace.spans import CATEGORIES, current, set_current, span, tracing
from minidist.trace.timeline import ascii_timeline_from_events, bubble_fraction, median_bubble, plot_timeline
from minidist.trace.tracer import Tracer, trace_layers

__all__ = ["CATEGORIES", "Tracer", "append_part", "ascii_timeline_from_events",
           "bubble_fraction", "chrome_trace", "current", "gather_events", "hidden_fraction",
           "median_bubble", "plot_timeline", "read_parts", "set_current", "span", "trace_layers",
           "tracing", "write_chrome_trace"]
