"""Heartbeats: how a supervisor tells a hung rank from a slow one.

The training loop rewrites one small file per rank every step (``heartbeat(rank, step)``) in
``$MINIDIST_HEARTBEAT_DIR``; ``minidist.comm.run`` beats once as each rank starts (step ``STARTED``),
which covers the time before the first step. The supervisor reads the beats (``read_heartbeats``),
finds the ranks silent for longer than its timeout (``stale_ranks``), and of those blames the one
that got least far (``blame``). ``minidist.resilience.supervisor`` re-exports all of these.
"""

from __future__ import annotations

import os
import time

STARTED = -1  # the step of the beat ``minidist.comm.run`` writes as a rank starts: alive, no step yet


def heartbeat(rank: int, step: int) -> None:
    """Tell the supervisor this rank is alive and at ``step`` (no-op without a supervisor)."""
    d = os.environ.get("MINIDIST_HEARTBEAT_DIR")
    if not d:
        return
    path = os.path.join(d, f"rank-{rank}")
    with open(path + ".tmp", "w") as f:
        f.write(f"{step} {time.time()}\n")
    os.replace(path + ".tmp", path)


def read_heartbeats(d) -> dict[int, tuple[int, float]]:
    """{rank: (last step, wall time of the beat)} from a heartbeat directory."""
    beats = {}
    for name in os.listdir(d) if os.path.isdir(d) else []:
        if name.startswith("rank-") and not name.endswith(".tmp"):
            try:
                step, t = open(os.path.join(d, name)).read().split()
                beats[int(name[5:])] = (int(step), float(t))
            except (OSError, ValueError):
                continue  # being replaced right now
    return beats


def stale_ranks(beats: dict, n: int, now: float, timeout: float) -> dict[int, float]:
    """{rank: seconds silent} for the ranks silent for more than ``timeout``. Once the job is up (a
    rank has beaten: ``minidist.comm.run`` beats as each rank starts), a rank that never beat is
    counted from the job's first beat, so a hang before a rank's first step is caught too."""
    if not beats:
        return {}  # not started yet (or a command that never beats): nothing to judge
    first = min(t for _, t in beats.values())
    last = {r: beats[r][1] if r in beats else first for r in range(n)}
    return {r: now - t for r, t in last.items() if now - t > timeout}


def blame(beats: dict, stale: dict) -> int:
    """The rank that stopped, of the ``stale`` ones: the one that got least far (never beat, then the
    lowest step), then the one silent longest -- its peers went on until they waited for it."""
    def progress(r):
        step = beats[r][0] if r in beats else STARTED - 1
        return (step, -stale[r])
    return min(stale, key=progress)
