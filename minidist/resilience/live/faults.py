"""Faults for a live job: kill or hang one member of a replica group at a step, or make it unreachable.

``--fault`` (or ``LiveInjector.parse``) lists faults separated by ``;``, each ``kind:key=value,...``::

    kill:group=1,step=5                   the member at position 0 of group 1 dies when step 5 begins
    kill:group=1,step=5,pos=1,phase=reduce   ... position 1, just before the step's reduction
    kill:group=0,phase=donate             group 0's member dies as it starts sending its state to a healer
    hang:group=2,step=4                   it stops and never answers (its heartbeat goes silent)
    unreachable:group=1,incarnation=1     the replacement of group 1 accepts no connection

``incarnation`` (default 0: the original group) picks which life of the group the fault hits, so a
replacement does not fail the same way, and ``attempt`` (default 0) which start of the whole job
(``MINIDIST_RESTART``: a restarted job does not fail again); without ``step`` a fault fires the
first time its phase comes. Processes die by SIGKILL; on the threads transport the member's thread
unwinds with ``Killed`` (a hung one waits until the run ends).
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass

KINDS = ("kill", "hang", "unreachable")
PHASES = ("compute", "reduce", "commit", "donate")


class Killed(BaseException):
    """A member of the threads transport was killed by a fault (its thread unwinds)."""


@dataclass
class LiveFault:
    kind: str
    group: int = 0
    step: int | None = None
    pos: int = 0
    incarnation: int = 0
    attempt: int = 0
    phase: str = "compute"
    text: str = ""


def parse(spec: str | None) -> list[LiveFault]:
    """``"kill:group=1,step=5;hang:group=0,step=3"`` -> faults; a bad part is a ValueError naming it."""
    out = []
    for part in filter(None, (p.strip() for p in (spec or "").split(";"))):
        kind, _, args = part.partition(":")
        if kind not in KINDS:
            raise ValueError(f"live fault {part!r}: unknown kind {kind!r}; known: {', '.join(KINDS)}")
        f = LiveFault(kind, text=part)
        for kv in filter(None, args.split(",")):
            m = re.fullmatch(r"\s*(group|step|pos|incarnation|attempt)=(\d+)\s*|\s*phase=(\w+)\s*", kv)
            if not m:
                raise ValueError(f"live fault {part!r}: bad argument {kv!r}; use group=G, step=S, pos=P, "
                                 f"incarnation=I, attempt=A or phase={'|'.join(PHASES)}")
            if m.group(3) is not None:
                if m.group(3) not in PHASES:
                    raise ValueError(f"live fault {part!r}: phase={m.group(3)!r}; use one of "
                                     f"{', '.join(PHASES)}")
                f.phase = m.group(3)
            else:
                setattr(f, m.group(1), int(m.group(2)))
        out.append(f)
    return out


class LiveInjector:
    """The faults meant for one member (its group, position and incarnation); ``at(step, phase)`` is
    called by the member's loop. ``process``: a real process (SIGKILL) or a thread (``Killed``)."""

    def __init__(self, faults, group: int, pos: int, incarnation: int, process: bool, member: int = -1):
        attempt = int(os.environ.get("MINIDIST_RESTART", "0"))
        self.faults = [f for f in faults if (f.group, f.pos, f.incarnation, f.attempt)
                       == (group, pos, incarnation, attempt)]
        self.process, self.member, self.group = process, member, group
        self.release = threading.Event()  # threads: a hung member waits for it (set when the run ends)

    @property
    def unreachable(self) -> bool:
        return any(f.kind == "unreachable" for f in self.faults)

    def _say(self, f: LiveFault, what: str) -> None:
        sys.stderr.write(f"[fault] group {self.group}, member {self.member}: {f.text} -> {what}\n")
        sys.stderr.flush()

    def at(self, step: int, phase: str) -> None:
        for f in self.faults:
            if f.kind not in ("kill", "hang") or f.phase != phase or f.step not in (None, step):
                continue
            if f.kind == "kill":
                self._say(f, "SIGKILL" if self.process else "killed")
                if self.process:
                    os.kill(os.getpid(), signal.SIGKILL)
                raise Killed(f.text)
            self._say(f, "hang")
            if self.process:
                while True:
                    time.sleep(3600)
            self.release.wait()
            raise Killed(f.text)
