"""A supervised job's attempts: what each one resumed from, how far it got, and the work lost.

``Attempt`` is the supervisor's record of one start of the job. ``newest_good_checkpoint`` is the
checkpoint the next attempt will resume from (checked as ``load`` checks it), ``elastic_size`` the
ranks an elastic restart runs on, and ``recomputed`` the steps each restart had to do again.
``minidist.resilience.supervisor`` re-exports all of these.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from minidist.resilience.checkpoint import files


@dataclass
class Attempt:
    number: int
    ranks: int
    start: float
    end: float = 0.0
    status: str = "running"
    resumed_from: int | None = None
    last_step: int | None = None
    failed_rank: int | None = None
    lost: list = field(default_factory=list)
    tier: str | None = None
    disk_full: str | None = None  # the job's note when a save found no room (or a read-only folder)


def newest_good_checkpoint(root, job=None) -> tuple[int | None, list[str]]:
    """(step, problems) of the checkpoint a restart of ``job`` will resume from, checked as ``load``
    does (another job's is skipped; ``job`` None: any job's)."""
    if not root:
        return None, []
    dirs, problems = files.candidates(root)
    for d in dirs:
        try:
            m = files.read_manifest(d)
            bad = [e for n, meta in m["files"].items() if (e := files.check_file(d, n, meta))]
            if job is not None and m.get("job") != job:
                bad = [f"written by job {m.get('job')!r}, not this job {job!r}"]
        except files.CheckpointError as e:
            bad = [str(e)]
        if not bad:
            return m["step"], problems
        problems.append(f"{os.path.basename(d)}: {'; '.join(bad)}")
    return None, problems


def elastic_size(n: int, left: int) -> int:
    """The ranks an elastic restart uses when ``left`` of the job's original ``n`` survive: the largest
    divisor of n that is at most ``left``, so a data-parallel split of the original batch still divides
    (0 when no rank is left)."""
    return max((d for d in range(1, left + 1) if n % d == 0), default=0)


def recomputed(attempts) -> list:
    """Per attempt, the steps the next attempt had to redo: how far this one got minus where the next
    resumed (None for the last attempt, or one that never reported a step)."""
    out = []
    for a, nxt in zip(attempts, list(attempts[1:]) + [None]):
        ok = nxt is not None and a.last_step is not None
        out.append(a.last_step - (nxt.resumed_from or 0) if ok else None)
    return out


def _dash(v) -> str:
    return "-" if v is None else str(v)
