"""Asynchronous, two-tier checkpointing (GEMINI, SOSP '23: memory first, disk second).

A save has two halves. The *snapshot* copies this rank's pieces to host memory -- the only part
training must wait for. The *write* (file, fsync, sha256, and on rank 0 the manifest and commit)
needs no communication (``state.write_part``), so a background thread does it while the next steps
run. ``Checkpointer.wait()`` joins it; a new save first waits for the previous one (one in flight).

Tiers: a list of ``Tier(name, root, every, keep)``. Tier 1 is node-local shared memory
(``/dev/shm``: RAM, survives the process, written in memory-copy time) every few steps; tier 2 is
durable storage every M steps. ``restore`` takes the newest intact checkpoint over all tiers, the
fastest tier on a tie, and reports which tier and how long it took.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from minidist.checkpoint import files
from minidist.checkpoint.state import LoadInfo, TrainState, prepare, restore, snapshot, write_part


@dataclass
class Tier:
    name: str       # "memory", "disk"
    root: str       # its checkpoint directory
    every: int      # save every this many steps
    keep: int = 2


def shm_root(job: str) -> str:
    """A node-local shared-memory directory for ``job`` (``/dev/shm`` where there is one)."""
    shm = os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
    base = "/dev/shm" if shm else tempfile.gettempdir()
    return os.path.join(base, f"minidist-{os.getuid()}-{job}")


class Checkpointer:
    """Saves a ``TrainState`` to each tier when due; ``asynchronous=True`` writes in the background."""

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
        tmps = [prepare(self.comm, t.root, step) for t in tiers]
        job = (tiers, tmps, snap)
        if self.asynchronous:
            self.thread = threading.Thread(target=self._write, args=job, daemon=True,
                                           name=f"checkpoint-writer-{self.comm.rank}")
            self.thread.start()
        else:
            self._write(*job)
            self.comm.barrier()  # synchronous: every rank returns once the checkpoint is committed
        self.stalls.append(time.perf_counter() - t0)
        return True

    def _write(self, tiers, tmps, snap) -> None:
        for tier, tmp in zip(tiers, tmps):
            t0 = time.perf_counter()
            try:
                write_part(tier.root, tmp, self.comm.rank, self.comm.size, snap, tier.keep,
                           self.fault if tier is self.tiers[-1] else None)
                self.written.append((tier.name, snap.step, time.perf_counter() - t0))
            except (files.CheckpointError, OSError) as e:
                self.errors.append(f"{tier.name} step {snap.step}: {e}")
                sys.stderr.write(f"[minidist.checkpoint] rank {self.comm.rank}: {tier.name} checkpoint of "
                                 f"step "
                                 f"{snap.step} failed: {e}\n")

    def wait(self) -> None:
        """Block until the save in flight (if any) is written."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def restore(self, state: TrainState) -> tuple[LoadInfo, str | None]:
        """Restore from the newest intact checkpoint of any tier (collective); (info, tier name)."""
        self.wait()
        t0 = time.perf_counter()
        found, problems = [], []
        for i, tier in enumerate(self.tiers):
            path, manifest, probs = files.choose(self.comm, tier.root)
            problems += [f"{tier.name}: {p}" for p in probs]
            if path is not None:
                found.append((manifest["step"], -i, tier, path, manifest))
        if not found:
            return LoadInfo(None, None, problems, False, time.perf_counter() - t0), None
        step, _, tier, path, manifest = max(found, key=lambda f: (f[0], f[1]))
        resharded = restore(self.comm, path, manifest, state)
        return LoadInfo(step, path, problems, resharded, time.perf_counter() - t0), tier.name
