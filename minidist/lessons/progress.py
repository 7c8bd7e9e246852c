"""Progress bars for lessons with long work: tqdm, drawn only where someone is watching.

``progress(iterable, total=..., desc=...)`` wraps an iterable in a tqdm bar on rank 0 when
stdout is a terminal, and returns a bar that draws nothing otherwise (a pipe, a test, a
notebook's captured output, ranks other than 0), so logs stay clean. ``bar.set_postfix`` shows
the running loss beside the count; ``bar.close()`` ends the line.
"""

from __future__ import annotations

import sys

from tqdm.auto import tqdm


def shown(rank: int = 0, stream=None) -> bool:
    """True when a bar should be drawn: rank 0, writing to a terminal."""
    stream = sys.stdout if stream is None else stream
    return rank == 0 and hasattr(stream, "isatty") and stream.isatty()


def progress(iterable=None, *, total=None, desc=None, unit="step", rank: int = 0, **kw):
    """A tqdm bar over ``iterable`` (or ``total`` updates), silent unless ``shown(rank)``."""
    return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stdout,
                disable=not shown(rank), dynamic_ncols=True, leave=True, **kw)
