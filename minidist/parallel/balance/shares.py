"""Split a global batch of B rows in proportion to each rank's measured throughput.

Rank i processes a row in t_i seconds (its speed is s_i = 1/t_i rows per second). With n_i rows
it computes for n_i·t_i seconds, and the step waits for the slowest: T = max_i n_i·t_i. The best
split makes every rank finish together, n_i·t_i = T for all i, so n_i = T·s_i and Σ n_i = B gives

    n_i = B · s_i / Σ_j s_j,        T* = B / Σ_j s_j        (the balanced time)

Rows are whole, so ``proportional_shares`` hands them out one at a time to whichever rank would
finish its next row first, after giving every rank a ``minimum`` (a loss over zero rows has no
mean). ``ShareBalancer`` re-decides every ``every`` steps from the smoothed measurements and moves
shares only when the predicted step time improves by more than ``margin`` (hysteresis: noise alone
never moves rows back and forth).

Why the gradient stays exact: rank i's loss is the mean over its own n_i samples, and
``DistributedDataParallel.backward(loss, n_samples=n_i)`` weights its gradient by n_i and divides
the sum by N = Σ n_i: g = Σ_i (n_i/N)·g_i, the mean over the whole batch, whatever the n_i.
Chapter 13 (lessons/13-load-balancing.md) works an example, and what rounding B·s_i/Σs would cost.
"""

from __future__ import annotations

import heapq
import math

import numpy as np


def proportional_shares(total: int, speeds, minimum: int = 1) -> list[int]:
    """Integers n_i summing to ``total``, each >= ``minimum``, that minimise the slowest rank's time
    max_i n_i / s_i: the whole-row version of n_i = B·s_i / Σ_j s_j. Greedy: ``minimum`` rows each,
    then every further row to the rank that would finish it first ((n_i + 1) / s_i smallest, ties
    to the lower rank) -- optimal for equal rows on ranks of different speeds (each choice leaves
    the best possible finish time for the rows placed so far)."""
    speeds = [float(s) for s in speeds]
    p = len(speeds)
    if p < 1 or any(not (math.isfinite(s) and s > 0) for s in speeds):
        raise ValueError(f"proportional_shares: speeds must be finite numbers > 0, got {speeds}")
    if not isinstance(total, (int, np.integer)) or total < minimum * p:
        raise ValueError(f"proportional_shares: {total!r} rows cannot give {p} ranks {minimum} each; "
                         f"use a global batch of at least {minimum * p} rows")
    shares = [minimum] * p
    heap = [((minimum + 1) / s, i) for i, s in enumerate(speeds)]
    heapq.heapify(heap)
    for _ in range(int(total) - minimum * p):
        _, i = heapq.heappop(heap)
        shares[i] += 1
        heapq.heappush(heap, ((shares[i] + 1) / speeds[i], i))
    return shares


def offsets(shares) -> list[int]:
    """Where each rank's rows start in the global batch: rank i takes rows [off_i, off_i + n_i)."""
    return [0] + np.cumsum(shares)[:-1].astype(int).tolist()


def balanced_time(total: int, seconds_per_row) -> float:
    """T* = B / Σ_i s_i with s_i = 1 / t_i: the step time when every rank finishes together."""
    return float(total) / float(np.sum(1.0 / np.asarray(seconds_per_row, np.float64)))


def predicted_time(shares, seconds_per_row) -> float:
    """max_i n_i·t_i: the compute part of a step with these shares (the slowest rank's)."""
    return float(np.max(np.asarray(shares, np.float64) * np.asarray(seconds_per_row, np.float64)))


class ShareBalancer:
    """Each rank's share of a ``total``-row batch; ``decide`` moves them to follow throughput."""

    def __init__(self, total: int, size: int, every: int = 2, margin: float = 0.1, minimum: int = 1):
        if not isinstance(every, int) or every < 1 or not 0 <= margin < 1:
            raise ValueError(f"ShareBalancer: every must be an integer >= 1 and margin in [0, 1), got "
                             f"every={every!r}, margin={margin!r}")
        self.total, self.every, self.margin, self.minimum = total, every, margin, minimum
        self.shares = proportional_shares(total, [1.0] * size, minimum)
        self.decisions: list[tuple[int, list[int]]] = []  # (step after which shares moved, new shares)

    def decide(self, step: int, seconds_per_row) -> bool:
        """After step ``step`` (0-based): every ``every`` steps, move to shares proportional to 1/t_i if
        that predicts a step shorter by more than ``margin``. Returns whether the shares moved."""
        if (step + 1) % self.every:
            return False
        t = np.asarray(seconds_per_row, np.float64)
        if not np.all(t > 0):
            return False
        new = proportional_shares(self.total, 1.0 / t, self.minimum)
        if new != self.shares and predicted_time(new, t) < (1 - self.margin) * predicted_time(self.shares, t):
            self.shares = new
            self.decisions.append((step, list(new)))
            return True
        return False
