"""The checkpoint folder itself: whose it is, whether a save fits, and never deleting what is not ours.

* **Ownership.** Every job has an id (the supervisor makes one, or ``--job ID`` names it:
  ``MINIDIST_JOB_ID``, ``TrainState.job``). The first save into a folder writes a marker file,
  ``.minidist-checkpoints``, naming the job, atomically (``os.link``: of two jobs claiming a folder
  at once, one wins). Another job is refused with an error naming both (``check``, ``claim``):
  resume that job with ``--job ID``, or pick another folder. An unmarked folder must be empty.
* **Deleting** needs the marker (``remove``): a name alone (``step-*``, ``latest``) is never enough.
* **Links and other users.** The folder must be a real folder, owned by this user and writable by
  nobody else (who could plant a link in it); every file is opened with O_NOFOLLOW (files.py), so a
  symbolic link is an error, never written through.
* **Space.** Before a save, each rank reserves its whole file (``os.posix_fallocate``), and the ranks
  agree before anyone commits; a reservation that fails is a ``CheckpointSpaceError`` naming the
  path, the bytes needed and the bytes free. Read-only is checked at the file-system level
  (``statvfs``: ``chmod`` does not stop root) and by the write itself. Such an error raised into the
  job leaves a note for the supervisor (``note``), which then does not restart the job into it.
* **In use.** A job may hold a shared lock on its marker while it lives (``claim(hold=True)``);
  ``sweep`` deletes such folders once their lock is free (a killed job's ``/dev/shm`` tiers).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import secrets
import shutil
import stat
import threading
import time

from minidist.resilience.checkpoint import files
from minidist.resilience.checkpoint.errors import CheckpointError

MARKER = ".minidist-checkpoints"
_LEFTOVER = re.compile(r"^\.minidist-checkpoints\.[\w-]+\.tmp$")  # a marker a dead job was making
JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
NEW_JOB = object()  # ``check``'s job for a job whose id is not made yet: it owns no folder
_ANY = object()
SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
READONLY_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)
_HELD: dict = {}  # folder -> descriptor of its marker, locked shared while this process lives


class CheckpointSpaceError(CheckpointError):
    """A save that cannot be written: the disk is full or the folder is read-only."""

    def __init__(self, message: str, path: str = "", needed: int = 0):
        super().__init__(message)
        self.path, self.needed = path, needed


def new_job_id() -> str:
    """A fresh job id: the time to the second and 6 random digits, e.g. ``20250114-093012-408213``."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.randbelow(10**6):06d}"


def check_job_id(job: str) -> str:
    if not JOB_ID.match(job or ""):
        raise ValueError(f"job id {job!r}: use 1-64 letters, digits, '.', '_' or '-' (starting with a letter "
                         "or digit), e.g. the id the supervisor printed")
    return job


def _job(job) -> str:
    return "a new job" if job is NEW_JOB else "an unnamed job" if job is None else f"job {job!r}"


def refusal(root, theirs, job) -> str:
    """The error for ``job`` meeting a folder of job ``theirs``: both named, and what to do."""
    fix = (f"resume that job with `--job {theirs}`" if isinstance(theirs, str) and JOB_ID.match(theirs)
           else "remove the folder if that job is done")
    return (f"checkpoint folder {root} belongs to {_job(theirs)} (its {MARKER}); this is {_job(job)}: "
            f"{fix}, or pick another folder")


def free_bytes(folder) -> int:
    try:
        st = os.statvfs(folder)
    except OSError:
        return -1
    return st.f_bavail * st.f_frsize


def owner(root) -> dict | None:
    """The marker's content ({"by": "minidist", "job": ...}) of a folder minidist created, else None
    (a marker that is a symbolic link is not minidist's)."""
    try:
        fd = os.open(os.path.join(root, MARKER), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd) as f:
            m = json.load(f)
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) and m.get("by") == "minidist" else None


def check(root, job) -> None:
    """Raise CheckpointError unless ``job`` may save into ``root``: the rule ``claim`` applies before
    it writes anything, for a command to check before its run (``NEW_JOB``: a job owning nothing)."""
    root = os.fspath(root).rstrip("/") or os.fspath(root)
    if not root:
        raise CheckpointError("checkpoint folder '': an empty path; give a folder")
    if os.path.islink(root):
        raise CheckpointError(f"checkpoint folder {root} is a symbolic link (to {os.readlink(root)}); "
                              "minidist writes only into a real folder: pass the folder it points to")
    if not os.path.lexists(root):
        parent = os.path.dirname(os.path.abspath(root))
        while not os.path.isdir(parent):
            parent = os.path.dirname(parent)
        check_writable(parent)
        if not os.access(parent, os.W_OK | os.X_OK):
            raise CheckpointSpaceError(f"checkpoint folder {root}: cannot be made, {parent} is not writable",
                                       root)
        return
    if not os.path.isdir(root):
        raise CheckpointError(f"checkpoint folder {root}: exists and is not a folder")
    st = os.lstat(root)
    if st.st_uid != os.geteuid():
        raise CheckpointError(f"checkpoint folder {root} is owned by uid {st.st_uid}, not by this user (uid "
                              f"{os.geteuid()}), who could plant links in it: pick a folder of your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CheckpointError(f"checkpoint folder {root} is writable by other users (mode "
                              f"{stat.S_IMODE(st.st_mode):o}), who could plant links in it: "
                              f"`chmod go-w {root}`, or pick another folder")
    check_writable(root)
    entries = os.listdir(root)  # before the marker is read: one linked meanwhile is judged by its job
    links = sorted(e for e in entries if os.path.islink(os.path.join(root, e)))
    if links:  # minidist makes none: planted, to make a save write elsewhere
        raise CheckpointError(f"checkpoint folder {root} holds symbolic links ({', '.join(links[:3])}); "
                              "minidist never writes through one: remove them")
    mark = owner(root)
    if mark is None:
        foreign = sorted(e for e in entries if not _LEFTOVER.match(e))
        if foreign:
            raise CheckpointError(f"checkpoint folder {root} holds files minidist did not write "
                                  f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}) and "
                                  f"no {MARKER}; minidist saves (and prunes) only in an empty folder or one "
                                  "it made: pass a new or empty folder")
    elif job is NEW_JOB or mark.get("job") != job:
        raise CheckpointError(refusal(root, mark.get("job"), job))


def check_owner(comm, roots, job) -> None:
    """(Collective, before a load) the same CheckpointError on every rank if one of ``roots`` belongs
    to another job: its checkpoints are never resumed by this one."""
    err = None
    if comm.rank == 0:
        marks = [(r, owner(r)) for r in ([roots] if isinstance(roots, str | os.PathLike) else roots)]
        err = next((refusal(r, m.get("job"), job) for r, m in marks if m is not None and m.get("job") != job),
                   None)
    err = comm.bcast_obj(err, root=0)
    if err:
        raise CheckpointError(f"rank {comm.rank}: {err}")


def claim(root, job, hold: bool = False) -> None:
    """(Rank 0, before a save) make ``root`` minidist's folder for ``job``, or refuse (``check``).
    ``hold``: lock it as in use while this process lives (``sweep`` frees it after)."""
    check(root, job)
    if not os.path.lexists(root):
        os.makedirs(root, mode=0o755, exist_ok=True)
    if owner(root) is None:
        _write_marker(root, job, hold)
    check(root, job)  # what is there now: a real, private folder whose marker (the first linked) is ours
    if hold:
        _hold(root)


def _write_marker(root, job, held: bool) -> None:
    path = os.path.join(root, MARKER)
    tmp = f"{path}.{os.getpid()}-{threading.get_ident()}.tmp"
    with os.fdopen(files.open_for_write(tmp), "w") as f:
        mark = {"by": "minidist", "job": job, "held": held}
        if held and os.environ.get("MINIDIST_SUPERVISOR_PID"):  # the job outlives its ranks' processes
            mark["supervisor"] = int(os.environ["MINIDIST_SUPERVISOR_PID"])
        json.dump(mark, f)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)  # unlike a rename, never replaces a marker another job just wrote
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    files.fsync_dir(root)


def _hold(root) -> None:
    key = os.path.abspath(root)
    if key not in _HELD:
        fd = os.open(os.path.join(root, MARKER), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        fcntl.flock(fd, fcntl.LOCK_SH)
        _HELD[key] = fd


def remove(root, job=_ANY) -> None:
    """Delete a folder minidist made -- its marker is there, naming ``job`` if one is given -- with
    everything in it. Anything else is refused: names alone never make a folder minidist's."""
    if not os.path.lexists(root):
        return
    mark = owner(root) if os.path.isdir(root) and not os.path.islink(root) else None
    if mark is None:
        raise CheckpointError(f"{root}: not a checkpoint folder minidist created (no {MARKER} in it); "
                              "refusing to delete it: pass a new or empty folder")
    if job is not _ANY and mark.get("job") != job:
        raise CheckpointError(refusal(root, mark.get("job"), job))
    fd = _HELD.pop(os.path.abspath(root), None)
    if fd is not None:
        os.close(fd)
    shutil.rmtree(root)


def sweep(base, prefix: str, job) -> list[str]:
    """Delete the folders ``base/prefix*`` that dead jobs left: this user's, marked ``held`` by a job
    other than ``job``, whose lock no live process holds. Returns the folders deleted."""
    gone = []
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        d = os.path.join(base, name)
        if not name.startswith(prefix) or os.path.islink(d) or not os.path.isdir(d):
            continue
        mark = owner(d)
        mine = os.lstat(d).st_uid == os.geteuid()
        if mark is None or not mark.get("held") or mark.get("job") == job or not mine:
            continue
        if _alive(mark.get("supervisor")):  # between two attempts no rank holds the lock: the job lives
            continue
        try:
            fd = os.open(os.path.join(d, MARKER), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
        except BlockingIOError:
            pass  # its job is alive
        finally:
            os.close(fd)
    return gone


def _alive(pid) -> bool:
    """Is ``pid`` (an int, or None) a live process?"""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
    fd = files.open_for_write(path)
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
    """The clear error for an ``OSError`` of a save: disk full, read-only or a symbolic link in the
    way, naming the path (and the bytes)."""
    if e.errno in SPACE_ERRNOS:
        err = CheckpointSpaceError(f"{what}: disk full at {path}: it needs {needed:,} bytes, "
                                   f"{free_bytes(os.path.dirname(str(path))):,} are free ({e.strerror})",
                                   str(path), needed)
    elif e.errno in READONLY_ERRNOS:
        size = f" its {needed:,} bytes" if needed else ""
        err = CheckpointSpaceError(f"{what}: read-only at {path}: cannot write{size} ({e.strerror})",
                                   str(path), needed)
    elif e.errno == errno.ELOOP:
        link = e.filename or path
        return CheckpointError(f"{what}: {link} is a symbolic link; minidist never writes through one "
                               "(who put it there?): remove it")
    else:
        return CheckpointError(f"{what}: writing {path} failed: {e}")
    return err


def note(message: str, kind: str = "diskfull") -> None:
    """Leave ``message`` for the supervisor, which reads ``diskfull-*`` (a save that raised into the
    job for lack of space) and ``refused-*`` (a folder the job may not use) after a failure and then
    does not restart the job into the same failure."""
    hb = os.environ.get("MINIDIST_HEARTBEAT_DIR")
    if hb and os.path.isdir(hb):
        try:
            with os.fdopen(files.open_for_write(os.path.join(hb, f"{kind}-pid-{os.getpid()}")), "w") as f:
                f.write(message + "\n")
        except OSError:
            pass
