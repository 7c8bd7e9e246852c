"""Checks that every rank makes the same collective call: always-on stamps, and debug mode.

**Always on, free.** Each collective call gets a *stamp*: the MPI tag (or thread-mailbox tag) its
messages travel under, on the communicator's strict private channel, packs what the call is::

    bits 12-19: call number on this communicator (mod 256)   bits 7-11: the collective (KINDS)
    bits 3-6:   dtype (DTYPES; 0 = not stamped)               bits 1-2: op, or root mod 4
    bit 0:      phase (a second round of messages)

A message of another call never matches a receive of this one. While a receive waits, the
transport looks at the peer's next message: stamped differently, it raises
:class:`CollectiveMismatch` naming both calls -- a different collective, dtype, op or root, or a
rank that skipped a call (the numbers differ). Sizes are checked by every receive.

**Debug mode** (``MINIDIST_DEBUG=1``). Before a collective sends anything -- before any handshake
such as ``all_reduce(algorithm="auto")``'s agreement on the cost model -- the ranks exchange the
full signature (name, call number, shape, dtype, op, root, group size) and compare; if they differ,
every rank raises :class:`CollectiveMismatch` listing each rank's call. One gather + broadcast of a
small tuple per collective.
"""

from __future__ import annotations

import numpy as np

from minidist.comm.communicator import MAX_USER_TAG, CommError, format_op


class CollectiveMismatch(CommError):
    """Ranks of one group called different collectives (or with different shapes/dtypes/ops/roots)."""


KINDS = ("?", "ring_all_reduce", "recursive_doubling_all_reduce", "halving_doubling_all_reduce",
         "two_shot_all_reduce", "tree_all_reduce", "naive_all_reduce", "mpi_all_reduce", "reduce_scatter",
         "all_gather", "broadcast", "reduce", "all_to_all", "gather", "scatter", "shm_all_reduce")
DTYPES = ("any", "bool", "int8", "uint8", "int16", "int32", "int64", "uint32", "uint64", "float16",
          "bfloat16", "float32", "float64", "complex64", "complex128", "other")
OPS = ("sum", "mean", "max", "min")
_KIND = {k: i for i, k in enumerate(KINDS)}
_DTYPE: dict = {}


def dtype_code(dtype) -> int:
    code = _DTYPE.get(dtype)
    if code is None:
        name = np.dtype(dtype).name
        code = _DTYPE[dtype] = DTYPES.index(name) if name in DTYPES else len(DTYPES) - 1
    return code


def stamp(name: str, seq: int, dtype=None, op: str | None = None, root: int | None = None) -> int:
    """The tag of collective call number ``seq`` (a user tag < MAX_USER_TAG, phase bit clear).
    Runs on every collective call: a repeat of the last kind of call costs four identity checks."""
    global _last
    n, d, o, r, rest = _last
    if not (n is name and d is dtype and o is op and r == root):
        extra = OPS.index(op) if op in OPS else (root & 3 if root is not None else 0)
        rest = (_KIND.get(name, 0) << 7) | ((0 if dtype is None else dtype_code(dtype)) << 3) | (extra << 1)
        _last = (name, dtype, op, root, rest)
    return ((seq & 0xFF) << 12) | rest


_last: tuple = (None, None, None, None, 0)


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
    sigs = comm.twin("debug").allgather_obj(signature)
    if all(s == sigs[0] for s in sigs):
        return
    lines = "\n".join(f"  rank {r}: " + ", ".join(f"{k}={v}" for k, v in s.items())
                      for r, s in enumerate(sigs))
    differ = sorted({k for s in sigs for k in s if any(t.get(k) != s.get(k) for t in sigs)})
    raise CollectiveMismatch(f"rank {comm.rank}: the ranks of this group (size {comm.size}) called "
                             f"different collectives (differing: {', '.join(differ)}):\n{lines}")
