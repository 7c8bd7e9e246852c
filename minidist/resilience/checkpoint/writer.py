"""Writing one checkpoint: snapshot, reserve, write, agree, commit; any failure an error on every rank.

``snapshot`` copies this rank's pieces to host memory (the only part training waits for). Each
rank's file is planned before a byte is written (``plan_file``: its pieces and trailer, so its
exact size), reserved (folder.py), written and fsynced (``write_file``). Rank 0 then learns every
rank's account -- by message in the synchronous ``write_snapshot``, by sidecar files in the
background ``write_part`` (bounded by ``MINIDIST_TIMEOUT``) -- and commits only if every file is
whole (``_commit``: the sealed manifest, the rename, ``latest``). Otherwise the step's temporary
folder is removed and every rank raises the same ``CheckpointError`` (``CheckpointSpaceError``
for a full disk or a read-only folder, naming the path and the bytes needed); the previous
checkpoint stays the latest.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import dataclass

import numpy as np

from minidist.comm import default_timeout
from minidist.resilience.checkpoint import files, folder, integrity
from minidist.resilience.checkpoint.errors import CheckpointError


def write_sidecar(tmp, rank: int, obj: dict) -> None:
    """Rank ``rank``'s account of its file (pieces, sha256, small state), for rank 0 to collect."""
    files.write_json_atomic(os.path.join(tmp, f"rank-{rank:05d}.json"), obj)


def wait_sidecars(tmp, world: int, timeout: float, poll: float = 0.002) -> list[dict]:
    """Every rank's sidecar, in rank order, once all exist (written atomically: a present one is whole).
    A rank that could not even write its sidecar (a full disk) leaves ``rank-R.failed``; ``timeout``
    (``MINIDIST_TIMEOUT``) bounds the wait for one that left nothing."""
    paths = [os.path.join(tmp, f"rank-{r:05d}.json") for r in range(world)]
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(p) or os.path.exists(p[:-5] + ".failed") for p in paths):
        if time.monotonic() > deadline:
            missing = [r for r, p in enumerate(paths) if not os.path.exists(p)]
            raise CheckpointError(f"{tmp}: ranks {missing} did not finish writing within {timeout:g} s "
                                  "(MINIDIST_TIMEOUT)")
        time.sleep(poll)
    out = []
    for r, p in enumerate(paths):
        if not os.path.exists(p):
            why = {"error": f"rank {r}: could not write its file or its account (disk full?)", "space": True}
            with contextlib.suppress(OSError, ValueError), open(p[:-5] + ".failed") as f:
                why = json.load(f)
            out.append(why)
            continue
        with open(p) as f:
            out.append(json.load(f))
    return out


@dataclass
class Snapshot:
    """A rank's part of one checkpoint, copied to host memory: what the (background) writer needs."""

    step: int
    arrays: list          # host copies, in slot order
    specs: list           # (name, global shape, dtype, spec) per array
    small: dict
    mesh: dict
    seconds: float = 0.0  # how long the copy took (the training stall of an asynchronous save)
    job: str | None = None
    config: dict | None = None


def snapshot(comm, step: int, state) -> Snapshot:
    """Copy this rank's owned pieces of ``state`` (a ``TrainState``) to host memory (collective: ranks
    agree who writes replicas)."""
    t0 = time.perf_counter()
    slots, _ = state.slots()
    keys = [s.key() for s in slots]
    first = {}
    for r, ks in enumerate(comm.allgather_obj(keys)):
        for k in ks:
            first.setdefault(k, r)
    mine = [s for s in slots if first[s.key()] == comm.rank]
    arrays = [np.array(s.get(), copy=True) for s in mine]
    specs = [(s.name, list(s.shape), np.dtype(s.dtype).str, s.spec()) for s in mine]
    mesh = dict(state.mesh, world=comm.size)
    return Snapshot(step, arrays, specs, state.small_state(), mesh, time.perf_counter() - t0, state.job,
                    state.config)


def plan_file(snap: Snapshot, rank: int) -> tuple[list[dict], bytes, int]:
    """(pieces, trailer, file size) of rank ``rank``'s file of ``snap`` -- known before a byte is
    written, so the space can be reserved and agreed on first."""
    pieces, offset = [], 0
    for a in snap.arrays:
        pieces.append({"offset": offset, "nbytes": a.nbytes, "dtype": a.dtype.str, "shape": list(a.shape)})
        offset += a.nbytes
    own = [{"name": name, "global_shape": shape, "global_dtype": dtype, **piece, **spec}
           for piece, (name, shape, dtype, spec) in zip(pieces, snap.specs)]
    tail = integrity.trailer_bytes(json.loads(json.dumps(
        {"rank": rank, "small": snap.small, "pieces": own, "step": snap.step, "job": snap.job,
         "config": snap.config, "mesh": snap.mesh})))
    return pieces, tail, offset + len(tail)


def _what(step: int, rank: int) -> str:
    return f"rank {rank}"


def _err(e: Exception) -> tuple[str, bool]:
    return str(e), isinstance(e, folder.CheckpointSpaceError)


def _raise(err: tuple[str, bool], prefix: str = ""):
    cls = folder.CheckpointSpaceError if err[1] else CheckpointError
    raise cls(prefix + err[0])


def prepare(comm, root, step: int, fault=None, job=None) -> str:
    """The empty temporary directory of checkpoint ``step`` (collective: rank 0 claims ``root`` for
    ``job`` -- folder.py -- and makes it, all get it, or all raise the same CheckpointError)."""
    tmp, err = None, None
    if comm.rank == 0:
        where = os.path.join(root, files.step_dir_name(step) + ".tmp")
        try:
            if fault is not None:
                fault.before_create(where)
            folder.claim(root, job)
            tmp = files.begin_step(root, step)
        except CheckpointError as e:
            err = _err(e)
        except OSError as e:
            err = _err(folder.space_error(e, where, 0, _what(step, 0)))
    tmp, err = comm.bcast_obj((tmp, err), root=0)
    if err:
        _raise((f"checkpoint of step {step} not written ({err[0]}); the previous one stays the latest",
                err[1]), f"rank {comm.rank}: ")
    return tmp


def write_file(tmp, rank: int, snap: Snapshot, fault=None, writer: int | None = None,
               reserve: bool = True) -> dict:
    """Reserve (unless done already), write and fsync rank ``rank``'s file; its account for the
    manifest, with ``error`` set (and no file left) if it could not be written."""
    fname = files.rank_file_name(rank)
    path = os.path.join(tmp, fname)
    pieces, tail, need = plan_file(snap, rank)
    try:
        if reserve:
            folder.reserve(path, need, fault)
        _, meta = files.write_pieces(path, snap.arrays, fault, trailer=lambda _: tail)
        meta["writer"] = rank if writer is None else writer
        if fault is not None:
            fault.after_write(path)
        return {"file": fname, "meta": meta, "pieces": pieces, "specs": snap.specs, "small": snap.small,
                "error": None}
    except OSError as e:
        err = folder.space_error(e, path, need, _what(snap.step, rank))
        with contextlib.suppress(OSError):
            os.remove(path)  # free what it took, so the others' accounts (and the note) still fit
        return {"file": fname, "error": str(err), "space": isinstance(err, folder.CheckpointSpaceError)}


def _latest(root) -> str | None:
    try:
        with open(os.path.join(root, files.LATEST)) as f:
            return f.read(64).strip()
    except (OSError, UnicodeDecodeError):
        return None


def _commit(root, tmp, snap: Snapshot, parts, keep: int, writer: int) -> tuple[str | None, tuple | None]:
    """(Rank 0) commit when every rank's file is whole; else remove ``tmp``. (directory, error)."""
    errors = [p for p in parts if p.get("error")]
    if not errors:
        try:
            m = integrity.seal(dict(_manifest(snap, parts), committed_by=writer))
            return files.commit_step(root, snap.step, m, keep), None
        except OSError as e:
            final = os.path.join(root, files.step_dir_name(snap.step))
            if _latest(root) == files.step_dir_name(snap.step):
                return final, None  # committed; only pruning older steps failed
            shutil.rmtree(final, ignore_errors=True)  # renamed, but ``latest`` could not follow: undo
            err = folder.space_error(e, os.path.join(tmp, files.MANIFEST), 0, _what(snap.step, 0))
            errors = [{"error": str(err), "space": isinstance(err, folder.CheckpointSpaceError)}]
    shutil.rmtree(tmp, ignore_errors=True)
    msg = f"checkpoint of step {snap.step} not written ({'; '.join(p['error'] for p in errors)}); " \
          "the previous one stays the latest"
    return None, (msg, any(p.get("space") for p in errors))


def write_part(root, tmp, rank: int, world: int, snap: Snapshot, keep: int = 3, fault=None,
               timeout: float | None = None, writer: int | None = None, reserved: bool = False) -> str | None:
    """Write rank ``rank``'s file and its sidecar into ``tmp`` -- no communication, so a background
    thread may run it while training goes on. The writer of rank 0's file then waits (at most
    ``timeout`` s, default ``MINIDIST_TIMEOUT``) for every sidecar and commits the checkpoint
    (manifest, rename, ``latest``); it returns the directory (other writers: None). ``writer``: the
    rank doing the writing, if not ``rank`` itself (a peer tier), recorded in the manifest.
    ``reserved``: the file's space was reserved already."""
    writer = rank if writer is None else writer
    side = write_file(tmp, rank, snap, fault, writer, reserve=not reserved)
    try:
        write_sidecar(tmp, rank, side)
    except OSError as e:
        err = folder.space_error(e, os.path.join(tmp, f"rank-{rank:05d}.json"), 0, f"rank {rank}")
        failed = os.path.join(tmp, f"rank-{rank:05d}.failed")
        try:
            space = isinstance(err, folder.CheckpointSpaceError)
            files.write_json_atomic(failed, {"error": str(err), "space": space})
        except OSError:  # a full disk: an empty file may still fit
            with contextlib.suppress(OSError):
                os.close(files.open_for_write(failed))
    if rank != 0:
        return None
    try:
        parts = wait_sidecars(tmp, world, default_timeout() if timeout is None else timeout)
    except CheckpointError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    final, err = _commit(root, tmp, snap, parts, keep, writer)
    if err:
        _raise(err)
    return final


def write_snapshot(comm, root, snap: Snapshot, keep: int = 3, fault=None) -> str:
    """Write a snapshot as checkpoint ``step`` under ``root``, now (collective, atomic; see files.py).
    The ranks' accounts go to rank 0 by message; it commits only if every file is whole, and every
    rank returns the directory or raises the same CheckpointError (disk full, read-only: naming the
    path and the bytes needed); the failed step's files are removed, the previous one stays."""
    try:
        tmp = prepare(comm, root, snap.step, fault, snap.job)
        parts = comm.gather_obj(write_file(tmp, comm.rank, snap, fault), root=0)
        final, err = _commit(root, tmp, snap, parts, keep, 0) if comm.rank == 0 else (None, None)
        final, err = comm.bcast_obj((final, err), root=0)
        if err:
            _raise(err, f"rank {comm.rank}: ")
    except folder.CheckpointSpaceError as e:
        folder.note(str(e))  # the job will stop on it: tell the supervisor not to restart into it
        raise
    return final


def _manifest(snap: Snapshot, parts) -> dict:
    tensors, file_meta, ranks = {}, {}, []
    for p in parts:
        file_meta[p["file"]] = p["meta"]
        ranks.append(p["small"])
        for piece, (name, shape, dtype, spec) in zip(p["pieces"], p["specs"]):
            t = tensors.setdefault(name, {"shape": shape, "dtype": dtype, "pieces": []})
            t["pieces"].append({"file": p["file"], **piece, **spec})
    return {"format": files.FORMAT, "step": snap.step, "mesh": snap.mesh, "time": time.time(),
            "job": snap.job, "config": snap.config,
            "files": file_meta, "tensors": dict(sorted(tensors.items())), "ranks": ranks}
