"""Debug mode (``MINIDIST_DEBUG=1``): check that every rank calls the same collective.

Before a collective runs, the ranks of the group exchange a small signature -- collective name,
sequence number on this communicator, shape, dtype, op, root -- and compare. If they differ, every
rank raises :class:`CollectiveMismatch` listing what each rank called, instead of hanging or
silently adding the wrong arrays. Costs one gather + broadcast of a tuple per collective.
"""

from __future__ import annotations

from minidist.comm.communicator import CommError


class CollectiveMismatch(CommError):
    """Ranks of one group called different collectives (or with different shapes/dtypes)."""


def check_same_call(comm, signature: dict) -> None:
    """Raise on every rank unless every rank of ``comm`` passes an equal ``signature``."""
    sigs = comm.derived("debug").allgather_obj(signature)
    if all(s == sigs[0] for s in sigs):
        return
    lines = "\n".join(f"  rank {r}: " + ", ".join(f"{k}={v}" for k, v in s.items())
                      for r, s in enumerate(sigs))
    differ = sorted({k for s in sigs for k in s if any(t.get(k) != s.get(k) for t in sigs)})
    raise CollectiveMismatch(f"rank {comm.rank}: the ranks of this group (size {comm.size}) called "
                             f"different collectives (differing: {', '.join(differ)}):\n{lines}")
