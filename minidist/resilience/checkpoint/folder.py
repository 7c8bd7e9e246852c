"""The checkpoint folder itself: whose it is, whether a save fits, and never deleting what is not ours.

* **Ownership.** The first save into a folder writes a marker file, ``.minidist-checkpoints``, naming
  the job that owns it (``TrainState.job``; None: an unnamed job). minidist deletes only inside a
  folder with its marker, and only what it wrote; a folder holding anything else is refused with a
  clear error before a byte is written (``claim``). A second job pointed at the same folder is
  refused too: its checkpoints would replace the first job's, and each would resume the other.
* **Space.** Before a save, each rank reserves its whole file (``os.posix_fallocate``: the blocks
  are the file's, so the write that follows cannot run out of room half-way) and the ranks agree on
  the outcome before anyone commits. A reservation that fails is a ``CheckpointSpaceError`` naming
  the path, the bytes needed and the bytes free.
* **Read-only.** ``chmod`` does not stop root, so writability is checked at the file-system level
  (``statvfs``'s read-only flag) and by the write itself; an ``EROFS``/``EACCES`` is the same clear
  error. Such an error raised into the job leaves a note for the supervisor
  (``MINIDIST_HEARTBEAT_DIR/diskfull-*``), which then does not restart the job into the same failure.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil

from minidist.resilience.checkpoint.errors import CheckpointError

MARKER = ".minidist-checkpoints"
_OURS = re.compile(r"^(step-\d{8}(\.tmp)?|latest(\.tmp)?|\.minidist-checkpoints(\.tmp)?)$")
SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
READONLY_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)


class CheckpointSpaceError(CheckpointError):
    """A save that cannot be written: the disk is full or the folder is read-only."""

    def __init__(self, message: str, path: str = "", needed: int = 0):
        super().__init__(message)
        self.path, self.needed = path, needed


def free_bytes(folder) -> int:
    try:
        st = os.statvfs(folder)
    except OSError:
        return -1
    return st.f_bavail * st.f_frsize


def owner(root) -> dict | None:
    """The marker's content ({"job": ...}) of a folder minidist created, else None."""
    try:
        with open(os.path.join(root, MARKER)) as f:
            m = json.load(f)
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) and m.get("by") == "minidist" else None


def claim(root, job: str | None) -> None:
    """(Rank 0, before a save) make ``root`` minidist's folder for ``job``, or refuse: a folder with
    files minidist did not write, or one another job owns."""
    if not os.path.isdir(root):
        if os.path.exists(root):
            raise CheckpointError(f"checkpoint folder {root}: exists and is not a folder")
        os.makedirs(root, exist_ok=True)
    mark = owner(root)
    if mark is None:
        foreign = sorted(e for e in os.listdir(root) if not _OURS.match(e))
        if foreign:
            raise CheckpointError(f"checkpoint folder {root} holds files minidist did not write "
                                  f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); "
                                  "minidist saves (and prunes) only in an empty folder or one it made: "
                                  "pass a new or empty folder")
        _write_marker(root, job)
    elif mark.get("job") != job:
        raise CheckpointError(f"checkpoint folder {root} belongs to job {mark.get('job')!r} (its {MARKER}); "
                              f"this is job {job!r}: give each job its own folder")


def _write_marker(root, job) -> None:
    path = os.path.join(root, MARKER)
    with open(path + ".tmp", "w") as f:
        json.dump({"by": "minidist", "job": job}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def remove(root) -> None:
    """Delete a folder minidist made (its marker is there, or it holds only checkpoint steps and
    ``latest``); an empty one is removed too. Anything else is refused: minidist never deletes what
    it did not create."""
    if not os.path.lexists(root):
        return
    plain = os.path.isdir(root) and not os.path.islink(root)
    if plain and (owner(root) is not None or all(_OURS.match(e) for e in os.listdir(root))):
        shutil.rmtree(root)  # marked, or holding only what minidist names (steps, latest): ours
    else:
        raise CheckpointError(f"{root}: not a checkpoint folder minidist created (no {MARKER} in it); "
                              "refusing to delete it: pass a new or empty folder")


def check_writable(root) -> None:
    """Raise ``CheckpointSpaceError`` if ``root``'s file system is mounted read-only (works as root,
    where permission bits do not stop writes)."""
    try:
        ro = bool(os.statvfs(root).f_flag & os.ST_RDONLY)
    except OSError:
        ro = False
    if ro:
        raise CheckpointSpaceError(f"read-only at {root}: its file system is mounted read-only", root)


def reserve(path, nbytes: int, fault=None) -> None:
    """Create ``path`` with all of its ``nbytes`` blocks allocated now (ENOSPC here, not mid-write)."""
    if fault is not None:
        fault.before_create(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        if nbytes:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
    finally:
        os.close(fd)


def space_error(e: OSError, path, needed: int, what: str) -> CheckpointError:
    """The clear error for an ``OSError`` of a save: disk full or read-only, naming path and bytes."""
    if e.errno in SPACE_ERRNOS:
        err = CheckpointSpaceError(f"{what}: disk full at {path}: it needs {needed:,} bytes, "
                                   f"{free_bytes(os.path.dirname(str(path))):,} are free ({e.strerror})",
                                   str(path), needed)
    elif e.errno in READONLY_ERRNOS:
        size = f" its {needed:,} bytes" if needed else ""
        err = CheckpointSpaceError(f"{what}: read-only at {path}: cannot write{size} ({e.strerror})",
                                   str(path), needed)
    else:
        return CheckpointError(f"{what}: writing {path} failed: {e}")
    return err


def note(message: str) -> None:
    """Leave ``message`` for the supervisor (it reads ``diskfull-*`` after a failure): a save that
    raised into the job for lack of space (a tolerated background failure leaves none)."""
    hb = os.environ.get("MINIDIST_HEARTBEAT_DIR")
    if hb and os.path.isdir(hb):
        try:
            with open(os.path.join(hb, f"diskfull-pid-{os.getpid()}"), "w") as f:
                f.write(message + "\n")
        except OSError:
            pass
