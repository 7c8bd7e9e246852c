"""Fault tolerance: sharded, atomic, checksummed, reshardable checkpoints of the whole training state.

* ``files``   -- one directory per step, written atomically, verified on load, last k kept.
* ``layout``  -- which piece of which global tensor a rank holds; resharding by index sets.
* ``state``   -- ``TrainState`` and the one function pair ``save`` / ``load``.
* ``writer``  -- one save: snapshot, reserve, write, agree, commit (errors on every rank, never a hang).
* ``integrity`` -- every byte covered: the manifest's digest, each rank file's trailer, the checks between.
* ``folder``  -- the folder: owned by one job, space reserved, never deleting what minidist did not make.
* ``tiers``   -- asynchronous saves (snapshot, background writer) and the in-memory tier.
* ``errors``  -- ``CheckpointError``, ``CheckpointWarning``.

It saves the state it is handed and imports no technique. The loop a restart resumes is
``minidist.resilience.trainer``; the supervisor that restarts a failed job is
``python -m minidist.launch``; faults are injected by ``minidist.resilience.faults``.
Chapter: lessons/10-fault-tolerance.md.
"""

from minidist.resilience.checkpoint.errors import CheckpointError, CheckpointWarning
from minidist.resilience.checkpoint.files import list_steps
from minidist.resilience.checkpoint.state import Attrs, LoadInfo, TrainState, load, restore, save
from minidist.resilience.checkpoint.writer import Snapshot, snapshot, write_snapshot

__all__ = ["Attrs", "CheckpointError", "CheckpointWarning", "LoadInfo", "Snapshot", "TrainState",
           "list_steps", "load", "restore", "save", "snapshot", "write_snapshot"]
