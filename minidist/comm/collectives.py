"""Collectives built from point-to-point messages: each one a short function a lesson can show.

Every function is SPMD code for one rank: call it on every rank of ``comm`` with that rank's
array. Arrays of any backend come in; the algorithm runs on NumPy host buffers (what transports
move) and the result goes back in the caller's backend. Results are new arrays (functional).

=====================================  =============================  ====================
collective                             bytes sent per rank (N bytes)  steps (rounds)
=====================================  =============================  ====================
ring_all_reduce                        2(p-1)/p N  [1]                2(p-1)
recursive_doubling_all_reduce          N log2 p  (p a power of 2)     log2 p (+2 if not)
halving_doubling_all_reduce            2(p-1)/p N  (p a power of 2)   2 log2 p (+2 if not)
tree_all_reduce (reduce + broadcast)   <= 2 N ceil(log2 p)            2 ceil(log2 p)
naive_all_reduce (gather + broadcast)  root (p-1) N, others N         2(p-1)
shm_all_reduce (one node, no messages) N into shared memory [3]       1 per piece (two-shot 2)
reduce_scatter (ring)                  (p-1)/p N  [2]                 p-1
all_gather (ring)                      (p-1)/p N  (N = output size)   p-1
=====================================  =============================  ====================

[1] exactly ``2N - |c_r| - |c_{r+1}|`` with ``c = np.array_split(x.ravel(), p)`` in bytes: rank r
    sends every chunk but its own in reduce-scatter and every chunk but ``r+1`` in all-gather.
[2] exactly ``N - |c_r|``.
[3] two-shot also writes its reduced chunk: ``N + |c_r|`` per piece; bytes received = bytes read from
    the other ranks' buffers; one message per call (shm.py).

The algorithms live by family -- ``ring.py`` (ring all-reduce, reduce-scatter, all-gather),
``doubling.py`` (recursive doubling, two-shot, halving-doubling), ``tree.py`` (binomial trees, the
naive root) -- and this module holds the rest: MPI's own and the shared-memory all-reduce,
``all_reduce``'s choice among them, all-to-all, gather, scatter and the asynchronous forms. Every
name is importable from here.

Each algorithm opens its call with ``with collective(comm, name, x, op=op) as k`` (call.py): the
host staging, the op check, the ledger record, the stamp and debug mode's check live there, so the
body is only the algorithm: messages on ``k.comm`` (the communicator's strict private channel, which
never matches a user's point-to-point messages) under the call's stamp ``k.tag``, through the
Communicator's public interface (``sendrecv_buffer``, ``send_buffer``, ``recv_buffer``, ...).
"""

from __future__ import annotations

import numpy as np

from minidist.comm.call import check_op, collective, result_backend, unwatched
from minidist.comm.cost import agreed_crowded, choose_algorithm, shm_wins
from minidist.comm.debug import check_same_call
from minidist.comm.doubling import (  # noqa: F401 - the algorithms, importable from here
    halving_doubling_all_reduce,
    recursive_doubling_all_reduce,
    two_shot_all_reduce,
    wait_all,
)
from minidist.comm.handles import start_async
from minidist.comm.ring import (  # noqa: F401
    all_gather,
    reduce_scatter,
    ring_all_gather_chunks,
    ring_all_reduce,
    ring_chunks,
    ring_reduce_scatter_chunks,
    split_sizes,
)
from minidist.comm.transports.mpi import mpi_knows
from minidist.comm.transports.shm import shm_lane
from minidist.comm.tree import (  # noqa: F401
    broadcast,
    naive_all_reduce,
    reduce,
    tree_all_reduce,
    tree_broadcast_host,
    tree_reduce_host,
)

ALGORITHMS = ("auto", "ring", "recursive_doubling", "halving_doubling", "two_shot", "tree", "naive", "mpi",
              "shm")



# -- MPI's own, as the reference to beat --------------------------------------------------------

def mpi_all_reduce(comm, x, op: str = "sum"):
    """MPI's own ``Allreduce`` (buffer API) under MPI; on other transports the ring all-reduce.

    Blocking inside MPI (no watchdog, no stamps: only debug mode compares the ranks' calls): it is
    the yardstick, not part of minidist's algorithms, so it runs with nothing added.
    """
    if comm.transport != "mpi":
        return ring_all_reduce(comm, x, op)
    from mpi4py import MPI

    with collective(comm, "mpi_all_reduce", x, op=op) as k:
        if not mpi_knows(k.host.dtype):
            raise TypeError(f"rank {comm.rank}: MPI's Allreduce can't reduce {k.host.dtype} (it doesn't know "
                            f"the type); use one of minidist's algorithms, e.g. algorithm='ring'")
        buf = k.host.copy()
        mop = {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op]
        k.comm.mpi.Allreduce(MPI.IN_PLACE, buf, op=mop)
        return k.be.from_host(k.finish(buf))


# -- shared memory: ranks on one node read each other's buffers (shm.py) ----------------------------

def shm_all_reduce(comm, x, op: str = "sum"):
    """Through the node's shared memory, no messages (MPI transport, every rank on one node).

    Each rank copies x into its part of a shared window and posts the call; once every rank has
    posted, each adds up all ranks' buffers in rank order (one-shot), or, for large messages, its
    own chunk of them, which the others then copy (two-shot). Double buffering by call parity makes
    one wait per phase safe. Larger than the window: in pieces. shm.py explains the protocol.
    Elsewhere (threads, JAX devices, ranks on several nodes, an emulated slow link) this is the
    algorithm the cost model picks for ``auto``.
    """
    lane = getattr(comm, "shm", False)
    if lane is None:                             # MPI, first time: the window's handshake
        _check_before_handshake(comm, x, op, "shm")
        lane = shm_lane(comm)
    if not lane and comm.size > 1:
        return _BY_NAME[choose_algorithm(x.nbytes, comm.size, agreed_crowded(comm))](comm, x, op)
    if lane and type(x) is np.ndarray and unwatched(comm):  # (NumPy in, NumPy out, on any backend)
        return lane.call(comm, x, op)            # the same, with collective()'s work done leanly
    with collective(comm, "shm_all_reduce", x, op=op) as k:
        if not lane:
            return k.result(k.flat.copy())       # one rank: nothing to add
        out, sent, received, steps = lane.reduce(comm, k.tag, k.flat, op)
        comm.ledger.count_sendrecv(sent, received)
        k.rec.step(steps)
        return k.result(out)


_BY_NAME = {"ring": ring_all_reduce, "two_shot": two_shot_all_reduce,
            "recursive_doubling": recursive_doubling_all_reduce,
            "halving_doubling": halving_doubling_all_reduce, "tree": tree_all_reduce,
            "naive": naive_all_reduce, "mpi": mpi_all_reduce, "shm": shm_all_reduce}


def all_reduce(comm, x, op: str = "sum", algorithm: str = "auto"):
    """The reduction (sum/mean/max/min) of every rank's x, on every rank.

    ``algorithm="auto"``: on the MPI transport with every rank on one node and no emulated link,
    ``shm`` up to one window's piece, or at any size when ranks outnumber cores (``cost.shm_wins``);
    elsewhere (and for larger messages) the one the cost model
    predicts fastest for this size and group. Every rank gets the same answer (both are agreed
    once per communicator), so none waits for messages of another algorithm. In debug mode the
    ranks first compare their calls, before those agreements' handshakes."""
    if algorithm == "auto":
        lane = comm.shm if comm.transport == "mpi" else False
        if lane and (x.nbytes <= lane.cap or lane.crowded):  # the common case (cost.shm_wins), decided
            return shm_all_reduce(comm, x, op)
        if lane is None or comm.agreed_crowded is None:
            _check_before_handshake(comm, x, op, algorithm)
        if lane is None and shm_lane(comm) and shm_wins(x.nbytes, comm.shm.cap, comm.shm.crowded):
            return shm_all_reduce(comm, x, op)
        algorithm = choose_algorithm(x.nbytes, comm.size, agreed_crowded(comm))
    elif algorithm not in _BY_NAME:
        raise ValueError(f"rank {comm.rank}: unknown algorithm {algorithm!r}; use one of {ALGORITHMS}")
    return _BY_NAME[algorithm](comm, x, op)


def _check_before_handshake(comm, x, op, algorithm) -> None:
    """Debug mode: compare the ranks' calls before a handshake that a mismatch would hang."""
    if comm.debug and comm.size > 1:
        check_op(comm, op, x.dtype)
        check_same_call(comm, {"collective": "all_reduce", "seq": comm.seq + 1, "size": comm.size,
                               "shape": tuple(np.shape(x)), "dtype": str(x.dtype), "op": op,
                               "algorithm": algorithm})


# -- all-to-all, gather, scatter ----------------------------------------------------------------

def all_to_all(comm, chunks: list) -> list:
    """``chunks[j]`` goes to rank j; returns the list of what each rank sent to me (p-1 rounds:
    in round s send to rank r+s, receive from rank r-s)."""
    if len(chunks) != comm.size:
        raise ValueError(f"rank {comm.rank}: all_to_all needs {comm.size} chunks (one per rank), "
                         f"got {len(chunks)}")
    with collective(comm, "all_to_all") as k:
        c, be = k.comm, result_backend(comm, chunks[comm.rank])
        host = [np.ascontiguousarray(be.to_host(ch)) for ch in chunks]
        r, p = c.rank, c.size
        out = [None] * p
        out[r] = np.array(host[r], copy=True)
        for s in range(1, p):
            out[(r - s) % p] = c.sendrecv_buffer(host[(r + s) % p], (r + s) % p, None, (r - s) % p, k.tag,
                                                 header=True)
            k.rec.step()
        return [be.from_host(o) for o in out]


def gather(comm, x, root: int = 0) -> list | None:
    """Every rank's x, as a list on ``root`` (shapes may differ); None elsewhere."""
    root = comm.check_peer(root, "root")
    with collective(comm, "gather", root=root) as k:   # shapes and dtypes may differ: x not in the stamp
        c, be = k.comm, result_backend(comm, x)
        h = np.ascontiguousarray(be.to_host(x))
        k.rec.step(c.size - 1)
        if c.rank != root:
            c.send_buffer(h, root, k.tag, header=True)
            return None
        return [be.from_host(h.copy() if r == root else c.recv_buffer(None, r, k.tag, header=True))
                for r in range(c.size)]


def scatter(comm, chunks: list | None, root: int = 0):
    """``chunks[j]`` (given on root) to rank j; non-roots pass None."""
    root = comm.check_peer(root, "root")
    if comm.rank == root and (chunks is None or len(chunks) != comm.size):
        raise ValueError(f"rank {root}: scatter root needs {comm.size} chunks, got "
                         f"{None if chunks is None else len(chunks)}")
    with collective(comm, "scatter", root=root) as k:
        c = k.comm
        k.rec.step(c.size - 1)
        if c.rank == root:
            be = result_backend(comm, chunks[root])
            for r in range(c.size):
                if r != root:
                    c.send_buffer(np.ascontiguousarray(be.to_host(chunks[r])), r, k.tag, header=True)
            return be.from_host(np.array(be.to_host(chunks[root]), copy=True))
        return comm.backend.from_host(c.recv_buffer(None, root, k.tag, header=True))


# -- asynchronous versions ----------------------------------------------------------------------

def all_reduce_async(comm, x, op: str = "sum", algorithm: str = "auto"):
    """Start ``all_reduce`` in the background; ``.wait()`` on the returned Handle gives the result.
    Don't modify x before waiting (NumPy arrays are read by the worker thread)."""
    return start_async(comm, all_reduce, x, op=op, algorithm=algorithm)


def all_gather_async(comm, x, axis: int = 0, sizes=None):
    return start_async(comm, all_gather, x, axis=axis, sizes=sizes)


def reduce_scatter_async(comm, x, op: str = "sum", axis: int = 0):
    return start_async(comm, reduce_scatter, x, op=op, axis=axis)
