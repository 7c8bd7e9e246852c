"""Where minidist's executable cache lives on disk, who may write it, and how it is kept under its cap.

``<MINIDIST_JAX_CACHE>/exe`` holds one file per executable (``cache_dir``); ``evict`` removes the
least recently used until the folder fits ``MINIDIST_JAX_CACHE_MB``; ``stamp_unstamped`` gives
JAX's own cache entries the stamp its capped cache needs. A cache entry is code that the job runs
(a pickle and a compiled executable), so a folder that another user owns or can write is refused
(``private``): the cache is then off, with one warning saying why.
"""

from __future__ import annotations

import os
import stat
import sys

_REFUSED: set = set()  # folders already warned about (one warning a process)


def private(folder: str) -> bool:
    """Is ``folder`` this user's alone: owned by us, not writable by group or others? A missing
    folder is made so (0700). A refused one is said once on stderr."""
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        st = os.stat(folder)
    except OSError:
        return False  # can't be made or read: nothing to trust, nothing to keep
    why = ("owned by uid {st.st_uid}, not by this user (uid {uid})" if st.st_uid != os.getuid() else
           "writable by other users (mode {mode:o})" if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) else None)
    if why is None:
        return True
    if folder not in _REFUSED:
        _REFUSED.add(folder)
        sys.stderr.write(f"[minidist] the JAX compile cache folder {folder} is "
                         + why.format(st=st, uid=os.getuid(), mode=stat.S_IMODE(st.st_mode))
                         + "; its entries are code this job would run, so the cache is off. Use a "
                         "folder only you can write (chmod go-w, or MINIDIST_JAX_CACHE=<your folder>).\n")
    return False


def cache_root() -> str | None:
    """``MINIDIST_JAX_CACHE`` (default ~/.cache/minidist/jax), or None when it is ``0`` (off) or
    not ``private`` (refused)."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "minidist", "jax")
    root = os.environ.get("MINIDIST_JAX_CACHE", default)
    return None if root in ("0", "") or not private(root) else root


def cache_dir() -> str | None:
    """Where executables are kept (``<MINIDIST_JAX_CACHE>/exe``), or None when the cache is off."""
    root = cache_root()
    if root is None:
        return None
    exe = os.path.join(root, "exe")
    return exe if private(exe) else None


def limit_bytes() -> float:
    """``MINIDIST_JAX_CACHE_MB`` (default 2000) in bytes: the cap of ``exe/``, and of JAX's own files."""
    return 1e6 * float(os.environ.get("MINIDIST_JAX_CACHE_MB", "2000"))


def evict(limit_mb: float | None = None) -> int:
    """Keep the cache folder under ``limit_mb`` (``MINIDIST_JAX_CACHE_MB``, default 2000): remove
    the least recently used executables (a load touches its file) down to 80% of it, and temporary
    files a killed writer left over an hour ago. Any edit of minidist makes every key new, so
    without this a developer's cache would only grow. Returns how many files were removed."""
    import time

    folder = cache_dir()
    if folder is None or not os.path.isdir(folder):
        return 0
    limit = limit_bytes() if limit_mb is None else 1e6 * limit_mb
    entries, removed, now = [], 0, time.time()
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        try:
            st = os.stat(path)
            if name.startswith(".tmp-") and now - st.st_mtime > 3600:
                os.unlink(path)
                removed += 1
            elif name.endswith(".exe"):
                entries.append((st.st_mtime, st.st_size, path))
        except OSError:  # removed by another process meanwhile
            continue
    total = sum(size for _, size, _ in entries)
    if total <= limit:
        return removed
    for _, size, path in sorted(entries):  # oldest use first
        if total <= 0.8 * limit:
            break
        try:
            os.unlink(path)
            removed += 1
        except OSError:
            pass
        total -= size
    return removed


def stamp_unstamped(root: str) -> int:
    """Give JAX's own cache entries in ``root`` that have no access-time stamp one (the time the
    entry was written); returns how many.

    JAX's persistent cache writes ``<key>-cache`` and, only when its size is capped, a
    ``<key>-atime`` stamp (8 bytes, little-endian nanoseconds). Once capped (``persistent_cache``
    caps it), every write first looks for the least recently used entry and reads each stamp. One
    entry with no stamp -- written before the cap, or by a process killed between its two files --
    made every write fail ("Error writing persistent compilation cache entry ... -atime", a warning
    in the lesson's output), so nothing new was kept and nothing was evicted. Stamping, not
    deleting: the entries stay usable, whoever wrote them. JAX's lock on the folder is held meanwhile
    (a write of JAX's own is two files); a folder it cannot lock or write is left as is."""
    import filelock  # JAX's capped cache needs it too: persistent_cache calls this only when it's there

    try:
        names = set(os.listdir(root))
        lock = filelock.FileLock(os.path.join(root, ".lockfile"), timeout=10)  # JAX's own lock file
        lock.acquire()
    except (OSError, filelock.Timeout):
        return 0
    try:
        return _stamp(root, names)
    finally:
        lock.release()


def _stamp(root: str, names: set) -> int:
    stamped = 0
    for name in names:
        if name.endswith("-cache") and name[:-len("-cache")] + "-atime" not in names:
            try:
                written = os.stat(os.path.join(root, name)).st_mtime_ns
                with open(os.path.join(root, name[:-len("-cache")] + "-atime"), "wb") as fh:
                    fh.write(written.to_bytes(8, "little"))
                stamped += 1
            except OSError:  # removed meanwhile, or a read-only folder
                pass
    return stamped
