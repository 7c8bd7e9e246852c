"""Live recovery: training that a failure does not interrupt (chapter 10, section 6).

Replica groups train with a per-step quorum; a failed group leaves it and the others finish the step
without it; a replacement heals from a live peer over the transport and rejoins at a step boundary.
It is handed state and a job: it imports no technique (data parallelism over the quorum is
``minidist.parallel.data.live``).

* ``quorum``  -- the coordinator: each step's groups, failures, retries, ``LastGroupLost``.
* ``member``  -- one rank's loop, and the quorum it hands to data parallelism (``reduce``).
* ``heal``    -- a live peer's state (parameters, optimizer state, RNG, data position) to a replacement.
* ``fabric``  -- members that fail, leave and join; revocable communicators (threads);
  ``sockets`` -- the same over TCP, for processes; ``links`` -- the control plane.
* ``launch``  -- threads, or MPI ranks as agents of worker processes; ``faults`` -- kill, hang, unreachable.
"""

from minidist.resilience.live.errors import (
    GroupLeft,
    HealFailed,
    LastGroupLost,
    LiveError,
    NoLivePeer,
    Revoked,
    Unreachable,
)
from minidist.resilience.live.launch import LiveRun, run_agents, run_threads, serve_worker
from minidist.resilience.live.member import LiveMember, ReplicaView
from minidist.resilience.live.quorum import Coordinator, StepRecord

__all__ = ["Coordinator", "GroupLeft", "HealFailed", "LastGroupLost", "LiveError", "LiveMember", "LiveRun",
           "NoLivePeer", "ReplicaView", "Revoked", "StepRecord", "Unreachable", "run_agents", "run_threads",
           "serve_worker"]
