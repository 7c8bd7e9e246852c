"""Checks that every rank makes the same collective call: stamps read back, and debug mode.

**Always on, free.** Each collective call's messages travel under its *stamp* (call.py: call
number, kind, dtype, op or root packed into the tag), on the communicator's strict private channel,
so a message of another call never matches a receive of this one. While a receive waits, the
transport looks at the peer's next message: stamped differently, it raises
:class:`CollectiveMismatch` naming both calls (``describe`` reads a stamp back in words) -- a
different collective, dtype, op or root, or a rank that skipped a call. Every receive checks sizes.

**Debug mode** (``MINIDIST_DEBUG=1``). Before a collective sends anything -- before any handshake
such as ``all_reduce(algorithm="auto")``'s agreement on the cost model -- the ranks exchange the
full signature (name, call number, shape, dtype, op, root, group size) and compare; if they differ,
every rank raises :class:`CollectiveMismatch` listing each rank's call. One gather + broadcast of a
small tuple per collective.
"""

from __future__ import annotations

from minidist.comm import call
from minidist.comm.call import DTYPES, KINDS, stamp  # noqa: F401 - the stamp, importable here
from minidist.comm.communicator import MAX_USER_TAG, format_op
from minidist.comm.requests import CommError


class CollectiveMismatch(CommError):
    """Ranks of one group called different collectives (or with different shapes/dtypes/ops/roots)."""


OPS = tuple(call.OPS)


def describe(tag: int) -> str:
    """What a tag on a strict private channel says, in words."""
    if tag >= MAX_USER_TAG:
        return "a handshake message outside any collective (objects, barrier)"
    seq, kind, dt, extra, phase = tag >> 12, (tag >> 7) & 31, (tag >> 3) & 15, (tag >> 1) & 3, tag & 1
    name = KINDS[kind]
    what = (f"op {OPS[extra]}" if name.endswith("reduce") or name == "reduce_scatter"
            else f"root {extra} (mod 4)")
    return (f"a message of {name} call #{seq} (mod 256), dtype {DTYPES[dt]}, {what}"
            + (", second round" if phase else ""))


def stamp_mismatch(comm, source: int, expected: int, got: int) -> CollectiveMismatch:
    return CollectiveMismatch(
        f"rank {comm.rank} of {comm.size} ({comm.transport}), in {format_op(comm.origin.last_op)}: "
        f"waits for {describe(expected)} from rank {source}, but rank {source}'s next message is "
        f"{describe(got)}. The ranks called different collectives (or with another "
        f"dtype, op or root, or a rank skipped a call); MINIDIST_DEBUG=1 compares full signatures.")


def check_same_call(comm, signature: dict) -> None:
    """Raise on every rank unless every rank of ``comm`` passes an equal ``signature``."""
    sigs = comm.channel("debug").allgather_obj(signature)
    if all(s == sigs[0] for s in sigs):
        return
    lines = "\n".join(f"  rank {r}: " + ", ".join(f"{k}={v}" for k, v in s.items())
                      for r, s in enumerate(sigs))
    differ = sorted({k for s in sigs for k in s if any(t.get(k) != s.get(k) for t in sigs)})
    raise CollectiveMismatch(f"rank {comm.rank}: the ranks of this group (size {comm.size}) called "
                             f"different collectives (differing: {', '.join(differ)}):\n{lines}")
