"""Fault injection: make a training job fail on purpose, the ways real jobs fail.

``MINIDIST_FAULT`` (or a lesson's ``--fault``) lists faults separated by ``;``, each
``kind:key=value,...``::

    kill:rank=1,step=5        rank 1 kills itself with SIGKILL when step 5 begins (a crashed host)
    raise:rank=0,step=3       an exception (a bug, a NaN check) at step 3
    hang:rank=2,step=4        rank 2 stops at step 4 and never returns (a stuck collective, a hung GPU)
    slow:rank=1,step=2,seconds=0.5   rank 1 sleeps 0.5 s at every step from 2 on (a straggler)
    corrupt:rank=0,step=4     once rank 0's file of checkpoint 4 is written and hashed, flip bytes in it
    truncate:rank=0,step=4    ... cut rank 0's file of checkpoint 4 in half
    diskfull:rank=1,step=6    writing checkpoint 6 fails on rank 1 with ENOSPC part-way (after a first piece)
    nospace:rank=1,step=6     ... fails when rank 1 reserves its file's space, before a byte is written
    readonly:rank=0,step=6    ... fails with EROFS as if the folder were read-only (root ignores chmod)
    lose:rank=3,step=5        like kill, and the host is gone: the supervisor restarts on fewer ranks

``rank`` defaults to 0; a fault fires on the first attempt only (``attempt=K`` for another), so a
restarted job replays the same steps without failing again. Before acting, a fault leaves a note
for the supervisor (chapter 10, section 4): a SIGKILLed process cannot say why it died.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field

KINDS = ("kill", "raise", "hang", "slow", "corrupt", "truncate", "diskfull", "nospace", "readonly", "lose")


class InjectedFault(RuntimeError):
    """The exception a ``raise`` fault throws."""


@dataclass
class Fault:
    kind: str
    rank: int = 0
    step: int = 0
    attempt: int = 0
    seconds: float = 0.0
    text: str = ""

    def __str__(self):
        return self.text


def parse(spec: str) -> list[Fault]:
    """``"kill:rank=1,step=5;slow:rank=0,step=1,seconds=0.2"`` -> [Fault, Fault]; errors name the bad part."""
    faults = []
    for part in filter(None, (p.strip() for p in (spec or "").split(";"))):
        kind, _, args = part.partition(":")
        if kind not in KINDS:
            raise ValueError(f"MINIDIST_FAULT: unknown fault {kind!r} in {part!r}; known: {', '.join(KINDS)}")
        f = Fault(kind, text=part)
        for kv in filter(None, args.split(",")):
            m = re.fullmatch(r"(rank|step|attempt|seconds)=([0-9.]+)", kv.strip())
            if not m:
                raise ValueError(f"MINIDIST_FAULT: bad argument {kv!r} in {part!r}; use rank=R, step=S, "
                                 "attempt=A or seconds=X")
            setattr(f, m.group(1), float(m.group(2)) if m.group(1) == "seconds" else int(float(m.group(2))))
        faults.append(f)
    return faults


@dataclass
class Injector:
    """The faults meant for this rank in this attempt, with hooks the training loop and the
    checkpoint writer call: ``on_step``, ``before_create``, ``before_write``, ``after_write``."""

    rank: int
    faults: list = field(default_factory=list)

    @classmethod
    def from_env(cls, rank: int, spec: str | None = None) -> Injector:
        spec = os.environ.get("MINIDIST_FAULT", "") if spec is None else spec
        attempt = int(os.environ.get("MINIDIST_RESTART", "0"))
        return cls(rank, [f for f in parse(spec) if f.rank == rank and f.attempt == attempt])

    def _note(self, f: Fault, what: str) -> None:
        sys.stderr.write(f"[minidist.faults] rank {self.rank}: injected {f} -> {what}\n")
        sys.stderr.flush()
        hb = os.environ.get("MINIDIST_HEARTBEAT_DIR")
        if hb and os.path.isdir(hb):
            fd = os.open(os.path.join(hb, f"fault-rank-{self.rank}"),
                         os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            with os.fdopen(fd, "w") as fh:
                fh.write(f"{f.kind} {f.text}\n")

    def on_step(self, step: int) -> None:
        """Call at the start of every training step (``step``: the number of steps done before it)."""
        for f in self.faults:
            if f.kind == "slow" and step >= f.step:
                time.sleep(f.seconds)
            if f.step != step:
                continue
            if f.kind in ("kill", "lose"):
                self._note(f, "SIGKILL")
                os.kill(os.getpid(), signal.SIGKILL)
            elif f.kind == "raise":
                self._note(f, "exception")
                raise InjectedFault(f"rank {self.rank}: injected fault {f} at step {step}")
            elif f.kind == "hang":
                self._note(f, "hang")
                while True:
                    time.sleep(3600)

    def before_write(self, path, nbytes: int) -> None:
        """Called by the checkpoint writer before each piece after the first (and before the file's
        trailer); a ``diskfull`` fault fails it: the file is left part-written."""
        step = _step_of(path)
        for f in self.faults:
            if f.kind == "diskfull" and f.step == step:
                self._note(f, "ENOSPC")
                raise OSError(errno.ENOSPC, "No space left on device (injected)", str(path))

    def before_create(self, path) -> None:
        """Called before a checkpoint file or folder of a step is created (and its space reserved):
        ``readonly`` fails it with EROFS, ``nospace`` a rank file's reservation with ENOSPC."""
        step = _step_of(path)
        for f in self.faults:
            hit = f.kind == "readonly" or f.kind == "nospace" and str(path).endswith(".bin")
            if hit and f.step == step:
                self._note(f, "EROFS" if f.kind == "readonly" else "ENOSPC")
                code = errno.EROFS if f.kind == "readonly" else errno.ENOSPC
                raise OSError(code, f"{os.strerror(code)} (injected)", str(path))

    def after_write(self, path) -> None:
        """Called when this rank's checkpoint file is written (its sha256 already taken):
        ``corrupt`` flips bytes in it and ``truncate`` cuts it, as a torn write or bit rot would."""
        step = _step_of(path)
        for f in self.faults:
            if f.kind in ("corrupt", "truncate") and f.step == step:
                size = os.path.getsize(path)
                self._note(f, f"{f.kind} {path}")
                with open(path, "r+b") as fh:
                    if f.kind == "truncate":
                        fh.truncate(size // 2)
                    else:
                        fh.seek(size // 2)
                        b = fh.read(8)
                        fh.seek(size // 2)
                        fh.write(bytes(x ^ 0xFF for x in b))


def _step_of(path) -> int | None:
    m = re.search(r"step-(\d{8})", str(path))
    return int(m.group(1)) if m else None
