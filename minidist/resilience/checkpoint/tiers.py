"""Asynchronous, two-tier checkpointing (GEMINI, SOSP '23: memory first, disk second).

A save has two halves. The *snapshot* copies this rank's pieces to host memory -- the only part
training must wait for. The *write* (file, fsync, sha256, and on rank 0 the manifest and commit)
needs no communication (``state.write_part``), so a background thread does it while the next steps
run. ``Checkpointer.wait()`` joins it; a new save first waits for the previous one (one in flight).

Tiers: a list of ``Tier(name, root, every, keep, peer)``. Tier 1 is node-local shared memory
(``/dev/shm``: RAM, survives the process, written in memory-copy time) every few steps; tier 2 is
durable storage every M steps. A ``peer=True`` tier is GEMINI's: each rank sends its snapshot to
its ring neighbour (``exchange_with_buddy``: one sendrecv of the shard's bytes), and the neighbour
writes it -- into *its* node's memory -- as the owner's file, so losing one host's memory loses no
shard (on one host, as here, the copy lands in the same ``/dev/shm``; the recovery logic is the
same). ``restore`` takes the newest intact checkpoint over all tiers, the first-listed (fastest)
tier on a tie, and reports which tier and how long it took.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace

import numpy as np

from minidist.resilience.checkpoint import files, folder
from minidist.resilience.checkpoint.state import LoadInfo, TrainState, restore, warn_skipped
from minidist.resilience.checkpoint.writer import Snapshot, plan_file, prepare, snapshot, write_part


@dataclass
class Tier:
    name: str       # "memory", "disk"
    root: str       # its checkpoint directory
    every: int      # save every this many steps
    keep: int = 2
    peer: bool = False  # written by the ring neighbour, from a copy of this rank's snapshot


def shm_root(job: str) -> str:
    """A node-local shared-memory directory for ``job`` (``/dev/shm`` where there is one)."""
    shm = os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
    base = "/dev/shm" if shm else tempfile.gettempdir()
    return os.path.join(base, f"minidist-{os.getuid()}-{job}")


def sweep_shm(job) -> list[str]:
    """Free the shared-memory tiers that killed jobs left (``folder.sweep``: claimed with ``hold``, no
    live process holding them, not ``job``'s own). Returns the folders freed."""
    base = os.path.dirname(shm_root("x"))
    return folder.sweep(base, f"minidist-{os.getuid()}-", job)


def exchange_with_buddy(comm, snap: Snapshot) -> Snapshot:
    """Send this rank's snapshot to rank + 1 and receive rank - 1's (one ``sendrecv_buffer`` of a
    JSON header and the raw bytes of the arrays): the copy this rank keeps for its neighbour."""
    meta = json.dumps({"specs": snap.specs, "small": snap.small,
                       "arrays": [[a.dtype.str, list(a.shape)] for a in snap.arrays]}).encode()
    parts = [np.frombuffer(len(meta).to_bytes(8, "little") + meta, np.uint8)]
    parts += [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in snap.arrays]
    got = comm.sendrecv_buffer(np.concatenate(parts), (comm.rank + 1) % comm.size, None,
                               (comm.rank - 1) % comm.size, header=True)
    n = int.from_bytes(got[:8].tobytes(), "little")
    meta = json.loads(got[8:8 + n].tobytes())
    arrays, offset = [], 8 + n
    for dtype, shape in meta["arrays"]:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        arrays.append(got[offset:offset + nbytes].view(np.dtype(dtype)).reshape(shape))
        offset += nbytes
    return replace(snap, arrays=arrays, specs=[tuple(s) for s in meta["specs"]], small=meta["small"])


class Checkpointer:
    """Saves a ``TrainState`` to each tier when due; ``asynchronous=True`` writes in the background.
    ``fault`` (a ``minidist.resilience.faults.Injector``) acts on the last tier's writes (the disk)."""

    def __init__(self, comm, tiers: list[Tier], asynchronous: bool = True, fault=None):
        self.comm, self.tiers, self.asynchronous, self.fault = comm, list(tiers), asynchronous, fault
        self.thread: threading.Thread | None = None
        self.errors: list[str] = []
        self.stalls: list[float] = []     # seconds training waited, per save
        self.written: list[tuple] = []    # (tier, step, seconds of the write)

    def due(self, step: int) -> list[Tier]:
        return [t for t in self.tiers if t.every and step % t.every == 0]

    def maybe_save(self, step: int, state: TrainState) -> bool:
        """Save checkpoint ``step`` to every tier that is due (collective when any is). True if saved."""
        tiers = self.due(step)
        if not tiers:
            return False
        t0 = time.perf_counter()
        self.wait()
        snap = snapshot(self.comm, step, state)
        buddy = exchange_with_buddy(self.comm, snap) if any(t.peer for t in tiers) else None
        tiers, tmps = self._reserve(tiers, snap, buddy)
        job = (tiers, tmps, snap, buddy)
        if self.asynchronous:
            self.thread = threading.Thread(target=self._write, args=job, daemon=True,
                                           name=f"checkpoint-writer-{self.comm.rank}")
            self.thread.start()
        else:
            self._write(*job)
            self.comm.barrier()  # synchronous: every rank returns once the checkpoint is committed
        self.stalls.append(time.perf_counter() - t0)
        return True

    def _fail(self, tier: Tier, step: int, e) -> None:
        self.errors.append(f"{tier.name} step {step}: {e}")
        sys.stderr.write(f"[minidist.checkpoint] rank {self.comm.rank}: {tier.name} checkpoint of step "
                         f"{step} failed: {e}\n")

    def _reserve(self, tiers, snap, buddy) -> tuple[list, list]:
        """Make each tier's temporary directory and reserve this rank's file in it, in the
        foreground; the ranks agree (one all-gather) and a tier that fails anywhere -- read-only,
        no room -- is skipped on every rank, its directory removed. The background write then
        cannot run out of space half-way."""
        rank, size = self.comm.rank, self.comm.size
        ok, tmps, mine = [], [], []
        for tier in tiers:
            fault = self.fault if tier is self.tiers[-1] else None
            try:
                tmps.append(prepare(self.comm, tier.root, snap.step, fault, snap.job))
                ok.append(tier)
            except files.CheckpointError as e:
                self._fail(tier, snap.step, e)
        for tier, tmp in zip(ok, tmps):
            owner, data = ((rank - 1) % size, buddy) if tier.peer else (rank, snap)
            path = os.path.join(tmp, files.rank_file_name(owner))
            need = plan_file(data, owner)[2]
            try:
                folder.reserve(path, need, self.fault if tier is self.tiers[-1] else None)
                mine.append(None)
            except OSError as e:
                mine.append(str(folder.space_error(e, path, need, f"rank {rank}: {tier.name} checkpoint")))
        verdicts = self.comm.allgather_obj(mine)
        kept = []
        for i, (tier, tmp) in enumerate(zip(ok, tmps)):
            errs = [v[i] for v in verdicts if v[i]]
            if errs:
                if rank == 0:
                    shutil.rmtree(tmp, ignore_errors=True)
                self._fail(tier, snap.step, "; ".join(errs))
            else:
                kept.append((tier, tmp))
        return [t for t, _ in kept], [d for _, d in kept]

    def _write(self, tiers, tmps, snap, buddy) -> None:
        rank, size = self.comm.rank, self.comm.size
        for tier, tmp in zip(tiers, tmps):
            t0 = time.perf_counter()
            try:  # a peer tier: this rank writes its left neighbour's file, from the copy it received
                owner, mine = ((rank - 1) % size, buddy) if tier.peer else (rank, snap)
                write_part(tier.root, tmp, owner, size, mine, tier.keep,
                           self.fault if tier is self.tiers[-1] else None, self.comm.timeout, writer=rank,
                           reserved=True)
                self.written.append((tier.name, snap.step, time.perf_counter() - t0))
            except (files.CheckpointError, OSError) as e:
                self._fail(tier, snap.step, e)

    def wait(self) -> None:
        """Block until the save in flight (if any) is written."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def restore(self, state: TrainState) -> tuple[LoadInfo, str | None]:
        """Restore the newest step that the tiers hold whole between them (collective): each file
        from the first tier (the fastest) with an intact copy. Returns (info, the tiers used, e.g.
        "memory" or "memory+peer")."""
        self.wait()
        t0 = time.perf_counter()
        folder.check_owner(self.comm, [t.root for t in self.tiers], state.job)
        where, manifest, problems = files.choose(self.comm, [t.root for t in self.tiers], job=state.job,
                                                 any_job=False)
        warn_skipped(self.comm, problems, manifest)
        if where is None:
            return LoadInfo(None, None, problems, False, time.perf_counter() - t0), None
        resharded = restore(self.comm, where, manifest, state)
        dirs = sorted(set(where.values()))
        used = [t.name for t in self.tiers
                if any(os.path.normpath(os.path.dirname(d)) == os.path.normpath(t.root) for d in dirs)]
        info = LoadInfo(manifest["step"], dirs, problems, resharded, time.perf_counter() - t0)
        return info, "+".join(used)
