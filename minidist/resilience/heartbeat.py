"""Heartbeats: how a supervisor tells a hung rank from a slow one, and a killed rank from its peers.

The training loop rewrites one small file per rank every step (``heartbeat(rank, step)``) in
``$MINIDIST_HEARTBEAT_DIR``; ``minidist.comm.run`` calls ``started`` as each rank starts (a beat at
step ``STARTED``), which covers the time before the first step. The supervisor reads the beats
(``read_heartbeats``), finds the ranks silent for longer than its timeout (``stale_ranks``), and of
those blames the one that got least far (``blame``).

A rank killed in the middle of a step leaves beats like its peers', so ``started`` also opens
``alive/rank-R`` and keeps it open: the kernel closes it as the process ends, and the supervisor
watches that folder (``ExitOrder``, inotify), so it learns which rank process ended first, before
the launcher killed the others. A rank that ends the job by an exception leaves ``error-rank-R``.
``started`` also watches the supervisor (``MINIDIST_SUPERVISOR_PID``): if it dies, even by SIGKILL,
the rank process kills itself within ``ORPHAN_S`` seconds. ``supervisor.py`` re-exports these.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import struct
import sys
import threading
import time

STARTED = -1  # the step of the beat ``minidist.comm.run`` writes as a rank starts: alive, no step yet
ORPHAN_S = 1.0  # a rank process stops at most this long after its supervisor is gone
ALIVE = "alive"  # the folder of the files each rank process holds open while it lives
_OPEN: dict = {}  # rank -> descriptor of its alive file (open for the life of the process)
_WATCHING: list = []


def _write(path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def heartbeat(rank: int, step: int) -> None:
    """Tell the supervisor this rank is alive and at ``step`` (no-op without a supervisor)."""
    d = os.environ.get("MINIDIST_HEARTBEAT_DIR")
    if not d:
        return
    path = os.path.join(d, f"rank-{rank}")
    _write(path + ".tmp", f"{step} {time.time()}\n")
    os.replace(path + ".tmp", path)


def started(rank: int) -> None:
    """A rank is up (``minidist.comm.run``): beat, hold its alive file open, watch the supervisor."""
    heartbeat(rank, STARTED)
    hb = os.environ.get("MINIDIST_HEARTBEAT_DIR")
    alive = os.path.join(hb, ALIVE) if hb else None
    if alive and os.path.isdir(alive) and rank not in _OPEN:
        fd = os.open(os.path.join(alive, f"rank-{rank}"),
                     os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        os.write(fd, f"{os.getpid()}\n".encode())
        _OPEN[rank] = fd
    pid = int(os.environ.get("MINIDIST_SUPERVISOR_PID") or 0)
    if pid and not _WATCHING:
        _WATCHING.append(pid)
        threading.Thread(target=_watch, args=(pid,), daemon=True, name="minidist-supervisor-watch").start()


def ended_job(rank: int, error) -> None:
    """A rank ends the job by an exception (MPI_Abort follows): leave its name for the supervisor."""
    d = os.environ.get("MINIDIST_HEARTBEAT_DIR")
    if d and os.path.isdir(d):
        what = f"raised {type(error).__name__}: {error}" if error is not None else "aborted the job"
        with contextlib.suppress(OSError):
            _write(os.path.join(d, f"error-rank-{rank}"), what.splitlines()[0][:300] + "\n")


def _watch(pid: int) -> None:
    """Wait for the supervisor's process to end (a pidfd; polling where there is none), then stop."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        fd = None
    except (AttributeError, OSError):
        while _exists(pid):
            time.sleep(ORPHAN_S / 2)
        fd = None
    if fd is not None:
        select.select([fd], [], [])
    sys.stderr.write(f"[minidist] process {os.getpid()}: its supervisor (pid {pid}) is gone; stopping\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def die_with_parent() -> None:
    """(In a child, before exec) SIGTERM when the parent dies (Linux ``PR_SET_PDEATHSIG``)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1: PR_SET_PDEATHSIG


class ExitOrder:
    """The order in which an attempt's rank processes ended: inotify's close events on their
    ``alive`` files, queued by the kernel as each process ends (Linux; elsewhere none)."""

    def __init__(self, folder):
        self.folder, self.fd, self.names = folder, None, []
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
            if fd >= 0 and libc.inotify_add_watch(fd, os.fsencode(folder), 0x8) >= 0:  # IN_CLOSE_WRITE
                self.fd = fd
            elif fd >= 0:
                os.close(fd)

    def first(self) -> int | None:
        """The rank whose process ended first; None if none ended, or if the ranks share one process
        (threads: all end at once)."""
        while self.fd is not None:
            try:
                buf = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                break
            at = 0
            while at < len(buf):
                n = struct.unpack_from("iIII", buf, at)[3]
                self.names.append(buf[at + 16:at + 16 + n].rstrip(b"\0").decode())
                at += 16 + n
        pids = []
        for name in os.listdir(self.folder):
            with contextlib.suppress(OSError, ValueError), open(os.path.join(self.folder, name)) as f:
                pids.append(int(f.read()))
        ranks = [int(n[5:]) for n in self.names if n.startswith("rank-") and n[5:].isdigit()]
        return ranks[0] if ranks and len(set(pids)) == len(pids) else None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


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
