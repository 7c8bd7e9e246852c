"""A checkpoint on disk: a directory per step, made atomically, described by one JSON manifest.

    ckpt/
      step-00000040/            one finished checkpoint
        manifest.json           what every file holds (see below), written last, by rank 0
        rank-00000.bin          rank 0's pieces, raw bytes back to back (no pickle anywhere)
        rank-00001.bin
      step-00000050/
      latest                    "step-00000050": replaced last, atomically

Writing: every rank writes its file into ``step-N.tmp/`` and fsyncs it; rank 0 adds ``manifest.json``
(each file's sha256 and size, each piece's file, offset, dtype and shape), renames the directory to
``step-N`` (atomic: a reader sees the whole checkpoint or none of it), then replaces ``latest`` the
same way (``commit_step``). A crash at any moment leaves the old ``latest`` or the new one.

Reading (``choose``): the newest step is used if its manifest parses and every file has the recorded
size and sha256 (the ranks hash the files between them). A bad one is reported -- which file, what
is wrong -- and the next older is tried. Given several roots holding the same steps (tiers), each
file may come from any of them: the first intact copy wins.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil

import numpy as np

from minidist.resilience.checkpoint import integrity
from minidist.resilience.checkpoint.errors import CheckpointError, CheckpointWarning  # noqa: F401 (re-export)

FORMAT = "minidist-checkpoint/3"
MANIFEST = "manifest.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def rank_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.bin"


def sha256_file(path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def fsync_dir(path) -> None:
    """Make a directory's entries (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_for_write(path, truncate: bool = True, exclusive: bool = False) -> int:
    """A descriptor to write ``path`` (made 0644 if missing), never through a symbolic link: with
    O_NOFOLLOW a link there is ``ELOOP`` (``folder.space_error`` names it), not its target rewritten."""
    how = os.O_EXCL if exclusive else os.O_TRUNC if truncate else 0
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | how, 0o644)


def refuse_link(path) -> None:
    """``OSError(ELOOP)`` if ``path`` is a symbolic link: a folder minidist replaces is never a link."""
    if os.path.islink(path):
        raise OSError(errno.ELOOP, "a symbolic link where minidist writes", str(path))


def write_pieces(path, arrays, fault=None, trailer=None) -> tuple[list[dict], dict]:
    """Write host arrays back to back into ``path`` (reserved beforehand or not: it is not truncated),
    then ``trailer(pieces)`` -- the file's own account of itself, see integrity.py -- and fsync;
    return each piece's (offset, nbytes, dtype, shape) and the file's {"sha256", "bytes"}.
    ``fault`` (a ``minidist.resilience.faults`` hook) may fail the write part-way (disk full: some
    bytes are on disk) or damage the file after it was written."""
    arrays = [np.ascontiguousarray(a) for a in arrays]
    pieces, offset = [], 0
    for a in arrays:
        pieces.append({"offset": offset, "nbytes": a.nbytes, "dtype": a.dtype.str, "shape": list(a.shape)})
        offset += a.nbytes
    tail = trailer(pieces) if trailer is not None else b""
    h = hashlib.sha256()
    with os.fdopen(open_for_write(path, truncate=False), "wb") as f:
        bufs = [memoryview(a).cast("B") if a.size else b"" for a in arrays] + [tail]
        for i, buf in enumerate(bufs):
            if fault is not None and (i > 0 or len(bufs) == 1):  # part-way: after the first piece
                fault.before_write(path, len(buf))
            f.write(buf)
            h.update(buf)
        f.truncate(offset + len(tail))
        f.flush()
        os.fsync(f.fileno())
    return pieces, {"sha256": h.hexdigest(), "bytes": offset + len(tail)}


def read_piece(directory, piece: dict) -> np.ndarray:
    """One piece's bytes, read from its file at its offset (no other bytes are read)."""
    with open(os.path.join(directory, piece["file"]), "rb") as f:
        f.seek(piece["offset"])
        raw = f.read(piece["nbytes"])
    if len(raw) != piece["nbytes"]:
        raise CheckpointError(f"{piece['file']} in {directory}: {len(raw)} bytes at offset "
                              f"{piece['offset']}, "
                              f"the manifest says {piece['nbytes']} (truncated file)")
    return np.frombuffer(raw, dtype=np.dtype(piece["dtype"])).reshape(piece["shape"])


def write_json_atomic(path, obj) -> None:
    """``obj`` as compact JSON (the C encoder: an indented dump is several times slower), atomically."""
    tmp = f"{path}.tmp"
    with os.fdopen(open_for_write(tmp), "w") as f:
        f.write(json.dumps(obj, separators=(",", ":")))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def begin_step(root, step: int) -> str:
    """(Rank 0) a fresh, empty ``step-N.tmp`` directory; the leftovers of a crashed attempt are removed."""
    os.makedirs(root, exist_ok=True)
    tmp = os.path.join(root, step_dir_name(step) + ".tmp")
    refuse_link(tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    os.mkdir(tmp)  # fails if anything is there again: the folder written into is the one made here
    return tmp


def commit_step(root, step: int, manifest: dict, keep: int) -> str:
    """(Rank 0, after every rank's file is written and fsynced) manifest, rename, ``latest``, prune."""
    tmp = os.path.join(root, step_dir_name(step) + ".tmp")
    for name in os.listdir(tmp):
        if name.endswith(".json"):  # the sidecars: the manifest holds all they said
            os.remove(os.path.join(tmp, name))
    write_json_atomic(os.path.join(tmp, MANIFEST), manifest)
    fsync_dir(tmp)
    final = os.path.join(root, step_dir_name(step))
    refuse_link(final)
    if os.path.exists(final):  # the same step saved again (a restarted run): the new one replaces it
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_dir(root)
    latest = os.path.join(root, LATEST)
    with os.fdopen(open_for_write(latest + ".tmp"), "w") as f:
        f.write(step_dir_name(step))
        f.flush()
        os.fsync(f.fileno())
    os.replace(latest + ".tmp", latest)
    fsync_dir(root)
    prune(root, keep)
    return final


def prune(root, keep: int) -> None:
    """Delete all but the newest ``keep`` finished checkpoints, and the temporary directories of
    steps up to the newest (left by crashed saves; a later step's may still be being written)."""
    steps = list_steps(root)
    for s in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(os.path.join(root, step_dir_name(s)), ignore_errors=True)
    for name in os.listdir(root):
        m = re.match(r"^step-(\d{8})\.tmp$", name)
        if m and steps and int(m.group(1)) <= steps[-1]:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def list_steps(root) -> list[int]:
    """Steps of the finished checkpoint directories under ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for m in map(_STEP_DIR.match, os.listdir(root)) if m)


def candidates(root) -> tuple[list[str], list[str]]:
    """Step directories to try, newest first, and problems found (a ``latest`` that names no
    finished checkpoint). Every finished step is whole -- the rename is the commit -- so the newest
    verified one wins; ``latest`` is the pointer for readers that do not verify."""
    problems = []
    latest = os.path.join(root, LATEST)
    if os.path.lexists(latest):
        try:
            with open(latest, "rb") as f:
                name = f.read(64).decode("utf-8", "replace").strip()
        except OSError as e:
            name = f"<unreadable: {e.strerror}>"
        if not (_STEP_DIR.match(name) and os.path.isdir(os.path.join(root, name))):
            problems.append(f"{latest}: points to {name[:40]!r}, which is not a finished checkpoint")
    return [os.path.join(root, step_dir_name(s)) for s in reversed(list_steps(root))], problems


def read_manifest(directory) -> dict:
    """The manifest of a step directory, its digest and structure checked (CheckpointError if not)."""
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, "rb") as f:
            m = json.loads(f.read())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (the checkpoint was not finished)") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path}: a folder, not a manifest") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({str(e)[:80]}): truncated or corrupted") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        got = str(m.get("format") if isinstance(m, dict) else m)[:40]
        raise CheckpointError(f"{path}: format is {got!r}, expected {FORMAT!r}")
    step = _STEP_DIR.match(os.path.basename(os.path.normpath(directory)))
    return integrity.validate(integrity.unseal(m, path), path, int(step.group(1)) if step else None)


def check_file(directory, name: str, meta: dict, manifest: dict | None = None) -> str | None:
    """None if ``name`` has the manifest's size and sha256 (and, given the ``manifest``, its trailer
    says what the manifest says of it), else what is wrong with it."""
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        return f"{path}: missing"
    size = os.path.getsize(path)
    if size != meta["bytes"]:
        return f"{path}: {size} bytes, the manifest says {meta['bytes']} (truncated or overwritten)"
    if sha256_file(path) != meta["sha256"]:
        return f"{path}: sha256 differs from the manifest's (corrupted)"
    return integrity.cross_check(path, manifest, name) if manifest is not None else None


def _check(d, name: str, manifest: dict) -> str | None:
    try:
        return check_file(d, name, manifest["files"][name], manifest)
    except (OSError, KeyError, TypeError, ValueError, IndexError) as e:
        return f"{os.path.join(d, name)}: cannot be checked ({type(e).__name__}: {e})"


def choose(comm, roots, job=None, any_job: bool = True) -> tuple[dict | None, dict | None, list[str]]:
    """(where, manifest, problems) of the newest step with an intact copy of every file, the same on
    every rank. ``roots``: one checkpoint directory, or several holding the same steps (tiers: a file
    damaged or lost in one is taken from the next). ``where`` maps each file to the step directory
    it is read from; (None, None, problems) when no step is whole. Collective: rank r hashes files
    r, r + size, ...; the verdicts are all-gathered. (``latest`` is replaced last, so the newest
    whole step is normally its target; after a crash between the rename and that replacement, the
    newer step -- complete and verified -- is used.) Unless ``any_job``, a checkpoint another ``job``
    wrote is skipped."""
    roots = [roots] if isinstance(roots, str | os.PathLike) else list(roots)
    by_step, problems = {}, []
    if comm.rank == 0:
        for root in roots:
            dirs, probs = candidates(root)
            problems += probs
            for d in dirs:
                by_step.setdefault(int(_STEP_DIR.match(os.path.basename(d)).group(1)), []).append(d)
    by_step, problems = comm.bcast_obj((by_step, problems), root=0)
    for step in sorted(by_step, reverse=True):
        dirs, manifest, errs = by_step[step], None, []
        if comm.rank == 0:
            for d in dirs:
                try:
                    manifest = read_manifest(d)
                except CheckpointError as e:
                    errs.append(str(e))
                    continue
                if not any_job and manifest.get("job") != job:
                    errs.append(f"{d}: written by job {manifest.get('job')!r}, not this job {job!r}")
                    manifest = None
                    continue
                break
        manifest, errs = comm.bcast_obj((manifest, errs), root=0)
        where = {}
        if manifest is not None:
            names = sorted(manifest["files"])
            mine = {}
            for n in names[comm.rank::comm.size]:
                verdicts = [(d, _check(d, n, manifest)) for d in dirs]
                good = [d for d, e in verdicts if e is None]
                mine[n] = good[0] if good else [e for _, e in verdicts]
            for part in comm.allgather_obj(mine):
                for n, v in part.items():
                    if isinstance(v, str):
                        where[n] = v
                    else:
                        errs += v
            if len(where) == len(names):
                return where, manifest, problems
        problems.append(f"skipped {' + '.join(dirs)}: {'; '.join(errs)}")
    return None, None, problems
