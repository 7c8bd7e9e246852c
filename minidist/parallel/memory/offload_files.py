"""Offload folders and files that survive crashes: space reserved up front, folders owned by a pid.

``numpy.memmap`` files are sparse: creating one reserves no disk blocks, so a disk that fills up
later kills the process with SIGBUS on the first write to an unbacked page -- no message, no
traceback. ``reserved_memmap`` asks the file system for every block first (``os.posix_fallocate``):
a disk too small is an ``OSError`` naming the file, the bytes needed and the bytes free, raised
when the optimizer is built.

``make_private_folder(root, prefix)`` names each folder ``<prefix>-<host>-<pid>-<random>``. The
folders this process made are removed when it ends by SIGTERM or normal exit (a handler and
``atexit``); a process killed harder (``kill -9``, a peer of an ``MPI_Abort``) leaves its folder,
and the next ``make_private_folder`` in the same root sweeps every folder of this host whose owner
pid no longer runs (``os.kill(pid, 0)``). Folders of other hosts (a shared file system) are never
touched: their pids mean nothing here.
"""

from __future__ import annotations

import atexit
import errno
import os
import re
import shutil
import signal
import socket
import tempfile
import threading

import numpy as np

_LIVE: set[str] = set()  # folders this process owns and has not removed yet
_LOCK = threading.Lock()
_HANDLER = {"installed": False, "previous": None}


def _host() -> str:
    """This host's name, made safe for a file name (no dashes: they separate the fields)."""
    return re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname()) or "host"


def owner_of(name: str, prefix: str) -> tuple[str, int] | None:
    """(host, pid) encoded in a folder name made by ``make_private_folder``, or None."""
    m = re.fullmatch(re.escape(prefix) + r"-([A-Za-z0-9_]+)-(\d+)-.+", name)
    return (m.group(1), int(m.group(2))) if m else None


def pid_alive(pid: int) -> bool:
    """Does process ``pid`` exist? (``os.kill(pid, 0)``: no signal is sent.)"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by another user
        return True
    return True


def sweep_stale(root: str, prefix: str) -> list[str]:
    """Remove the folders in ``root`` named ``<prefix>-<this host>-<pid>-...`` whose pid is gone;
    returns the paths removed."""
    removed = []
    host = _host()
    for name in os.listdir(root):
        owner = owner_of(name, prefix)
        if owner is None or owner[0] != host or owner[1] == os.getpid() or pid_alive(owner[1]):
            continue
        path = os.path.join(root, name)
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            removed.append(path)
    return removed


def make_private_folder(root: str, prefix: str) -> str:
    """Sweep ``root`` of stale folders, then make a fresh one owned by this process (removed on
    SIGTERM and at exit unless ``untrack``-ed first, which ``OffloadedAdamW.close`` does)."""
    sweep_stale(root, prefix)
    _install_handlers()
    folder = tempfile.mkdtemp(prefix=f"{prefix}-{_host()}-{os.getpid()}-", dir=root)
    with _LOCK:
        _LIVE.add(folder)
    return folder


def untrack(folder: str) -> None:
    """``folder`` was removed by its owner: nothing left to clean up at exit."""
    with _LOCK:
        _LIVE.discard(folder)


def remove_live_folders() -> None:
    """Delete every folder this process still owns (on SIGTERM and at exit)."""
    with _LOCK:
        folders = list(_LIVE)
        _LIVE.clear()
    for f in folders:
        shutil.rmtree(f, ignore_errors=True)


def _on_sigterm(signum, frame):
    remove_live_folders()
    previous = _HANDLER["previous"]
    if callable(previous):
        previous(signum, frame)
        return
    # die of SIGTERM as before, so the parent sees the same exit status
    signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
    os.kill(os.getpid(), signal.SIGTERM)


def _install_handlers() -> None:
    """atexit always; the SIGTERM handler only from the main thread (Python's rule), where the
    lessons and scripts create their optimizers; threads-transport ranks get it through the import
    of this module in the main thread (below)."""
    if _HANDLER["installed"] or threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous not in (signal.SIG_DFL, None) and not callable(previous):
        return  # SIG_IGN: the program chose to ignore SIGTERM; leave it so
    if previous is _on_sigterm:
        return
    _HANDLER["previous"] = previous
    signal.signal(signal.SIGTERM, _on_sigterm)
    _HANDLER["installed"] = True


atexit.register(remove_live_folders)
try:
    _install_handlers()
except ValueError:  # pragma: no cover - an embedded interpreter without signals
    pass


def reserved_memmap(path: str, dtype, shape) -> np.memmap:
    """A zero-filled ``numpy.memmap`` at ``path`` whose disk blocks are reserved now.

    Raises ``OSError(ENOSPC)`` naming the file, the bytes it needs and the bytes free when the disk
    is too small. On a file system without ``posix_fallocate`` the zeros are written instead (the
    same guarantee, slower)."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        if nbytes:
            _reserve(fd, nbytes, path)
    finally:
        os.close(fd)
    return np.memmap(path, dtype=dtype, mode="r+", shape=shape)


def _reserve(fd: int, nbytes: int, path: str) -> None:
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except AttributeError:  # not on this platform (macOS)
            _write_zeros(fd, nbytes)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            _write_zeros(fd, nbytes)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        free = _free_bytes(os.path.dirname(path))
        raise OSError(e.errno, f"offload: no room for {os.path.basename(path)} in {os.path.dirname(path)}: "
                               f"it needs {nbytes:,} bytes, the disk has {free:,} free (or the quota is "
                               "reached); pass an offload_dir on a disk with room for the optimizer state, "
                               "or offload to host memory (where='host')", path) from None


def _write_zeros(fd: int, nbytes: int, chunk: int = 1 << 20) -> None:
    zeros = bytes(min(chunk, nbytes))
    left = nbytes
    while left:
        left -= os.write(fd, zeros[:min(chunk, left)])


def _free_bytes(folder: str) -> int:
    try:
        st = os.statvfs(folder)
    except OSError:
        return -1
    return st.f_bavail * st.f_frsize
