"""See the load: per-rank compute and wait time each step, agreed by every rank, and stragglers.

Each step every rank knows only its own clock. ``StepMonitor.record`` makes one tiny all-gather of
a few float64 numbers per rank (compute seconds, wait seconds, rows, and whatever the caller
piggy-backs: the loss sum and token count, so the global loss costs nothing extra), so after it
every rank holds the same (ranks x fields) table and every decision taken from it -- shares, a
re-partition -- is the same on every rank without another message. A window of the last few steps
is kept and ``smoothed`` takes its median per rank: one noisy step (a page fault, a neighbour's
burst on a shared machine) does not move work around.

``StragglerDetector`` names a rank whose seconds per row exceed the median rank's by more than
``threshold`` (0.5: 50% slower) for ``patience`` consecutive steps. Per *row*, not per step: once
the balancer has given a slow rank fewer rows its step time is back to the others', but it is still
the slow rank.
"""

from __future__ import annotations

import numpy as np

from minidist.comm import all_gather
from minidist.trace.spans import now

FIELDS = ("compute", "wait", "rows")


class StepMonitor:
    """Per step: this rank's numbers in, every rank's numbers out (``record``), smoothed over ``window``."""

    def __init__(self, comm, window: int = 3, extra: tuple = ()):
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"rank {comm.rank}: StepMonitor window must be an integer >= 1, got {window!r}")
        self.comm, self.window = comm, window
        self.fields = FIELDS + tuple(extra)
        self.history: list[np.ndarray] = []   # one (ranks, fields) table per step
        self.gather_seconds: list[float] = []  # what agreeing cost, per step

    def record(self, compute: float, wait: float, rows: int, *extra: float) -> np.ndarray:
        """All-gather this rank's (compute, wait, rows, *extra); returns the agreed (ranks, fields) table."""
        mine = np.array([compute, wait, rows, *extra], np.float64)
        if mine.size != len(self.fields):
            raise ValueError(f"rank {self.comm.rank}: record() got {mine.size} numbers for fields "
                             f"{self.fields}")
        t0 = now()
        table = all_gather(self.comm, mine, sizes="equal").reshape(self.comm.size, mine.size)
        self.gather_seconds.append(now() - t0)
        self.history.append(table)
        return table

    def column(self, name: str) -> np.ndarray:
        """(steps, ranks): one field over every recorded step."""
        k = self.fields.index(name)
        return np.array([t[:, k] for t in self.history])

    def smoothed(self, name: str) -> np.ndarray:
        """Median over the last ``window`` steps of one field, per rank."""
        return np.median(self.column(name)[-self.window:], axis=0)

    def seconds_per_row(self) -> np.ndarray:
        """Median over the window of compute / rows, per rank: the inverse of each rank's throughput."""
        recent = self.history[-self.window:]
        k, r = self.fields.index("compute"), self.fields.index("rows")
        return np.median([t[:, k] / np.maximum(t[:, r], 1) for t in recent], axis=0)


class StragglerDetector:
    """Names ranks slower than the median by ``threshold`` for ``patience`` consecutive updates."""

    def __init__(self, threshold: float = 0.5, patience: int = 2):
        if not threshold > 0 or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"StragglerDetector: threshold must be > 0 and patience an integer >= 1, got "
                             f"threshold={threshold!r}, patience={patience!r}")
        self.threshold, self.patience = threshold, patience
        self.count: dict[int, int] = {}
        self.events: list[tuple[int, int, float]] = []  # (step, rank, ratio to the median) when first named

    def update(self, step: int, seconds_per_row) -> list[int]:
        """The ranks that are stragglers now (slow for ``patience`` updates in a row)."""
        t = np.asarray(seconds_per_row, np.float64)
        med = float(np.median(t))
        out = []
        for r, v in enumerate(t):
            slow = med > 0 and v > (1 + self.threshold) * med
            self.count[r] = self.count.get(r, 0) + 1 if slow else 0
            if self.count[r] >= self.patience:
                out.append(r)
                if self.count[r] == self.patience:
                    self.events.append((step, r, v / med))
        return out
