"""All-reduce through shared memory: the ranks of one node add up each other's arrays where they lie.

Each rank has its part of an MPI-3 shared window (``MPI.Win.Allocate_shared`` on the node's
communicator) that every other rank reads as a NumPy array: a header and two parity buffers.
Call k: copy x into my buffer of parity ``k % 2`` and post k in my header (with the call's stamp
and size); wait until every peer posted k; then **one-shot** add up all p buffers in rank order, or
**two-shot** add up my chunk of them, post again, and copy the others' chunks. Every rank sums in
the same order, so the bits agree. Two buffers alternating by parity make one wait per call safe:
a peer posts k-1 only after it finished reading call k-2. Larger messages go in pieces.

Waits go through ``waiting.poll`` (the watchdog, "still waiting", a departed peer); a peer that
posted another call's stamp or size raises ``CollectiveMismatch`` / ``MessageMismatch``. Ledger: a
rank sends what it writes into the window and receives what it reads, one message and one step
per posting (``cost.all_reduce_counts("shm", ...)``). Chapter 2 walks through the protocol.
"""

from __future__ import annotations

import os
import platform
import threading

import numpy as np

from minidist.comm import cost
from minidist.comm.call import OPS, check_op, collective, stamp, unwatched
from minidist.comm.collectives import ALGORITHMS
from minidist.comm.cost import shm_two_shot_from
from minidist.comm.debug import stamp_mismatch
from minidist.comm.requests import MessageMismatch
from minidist.comm.waiting import poll

HEADER = 64                          # bytes per lane and rank: one cache line of int64 words
SEQ, SEQ2, CALL = 0, 1, 2            # header words: call posted, two-shot's 2nd phase, what[parity]:
TAG_BITS = 20                        # what = the call's stamp | its bytes << TAG_BITS (stamps < 2**20)
DEFAULT_BYTES = 4 << 20              # bytes per parity buffer (MINIDIST_SHM_BYTES): larger calls go in pieces
SMALLEST = 64 << 10                  # /dev/shm too full for this much per buffer: no shared memory
LANES = 2                            # the communicator's own calls, and its async channel's
NAME = "shm_all_reduce"

_windows: list = []                  # every window this process allocated, in order (freed in that order)
_lock = threading.Lock()             # the main thread and an async worker may both be first to attach


def window_bytes(p: int = 1) -> int:
    """Bytes per parity buffer: MINIDIST_SHM_BYTES (default 4 MiB; a multiple of 64), halved while
    ``p`` ranks' windows would take more than half of what is free in /dev/shm (a container's is
    often 64 MB, and running out there is a crash, SIGBUS, not an error)."""
    cap = max(64, int(os.environ.get("MINIDIST_SHM_BYTES", DEFAULT_BYTES)) // 64 * 64)
    try:
        st = os.statvfs("/dev/shm")
        free = st.f_bavail * st.f_frsize
    except OSError:
        return cap
    while 2 * p * LANES * (HEADER + 2 * cap) > free:
        if cap <= SMALLEST:
            return 0                     # no room: no shared memory (every rank agrees, see attach)
        cap = cap // 128 * 64
    return cap


class Lane:
    """One rank's view of one lane of a window: every rank's header and two parity buffers."""

    def __init__(self, slots: list, cap: int, rank: int, fence, two_shot_from: float, crowded: bool = False):
        self.rank, self.p, self.cap, self.fence = rank, len(slots), cap, fence
        self.crowded = crowded               # ranks outnumber cores (agreed): auto uses shm at any size
        self.two_shot_from = two_shot_from   # pieces of this many bytes and more go two-shot
        self.heads = [memoryview(s[:HEADER]).cast("q") for s in slots]  # (item access, no unpacking)
        self.data = [[s[HEADER + q * cap:HEADER + (q + 1) * cap] for s in slots] for q in (0, 1)]
        self.others = [j for j in range(self.p) if j != rank]
        self.calls = 0                   # protocol calls (pieces) on this lane so far
        self.plans: dict = {}            # (parity, dtype, n) -> every rank's buffer as n dtype, chunks
        self.kinds: dict = {}            # (op, dtype) -> its stamp's bits (debug.stamp of call 0)

    def plan(self, parity: int, dtype, n: int):
        """Every rank's parity buffer as ``n`` elements of ``dtype``, and the two-shot chunks
        (cached: a small call can't afford slicing them again)."""
        key = (parity, dtype, n)
        got = self.plans.get(key)
        if got is None:
            if len(self.plans) > 64:
                self.plans.clear()
            bufs = [d[:n * dtype.itemsize].view(dtype) for d in self.data[parity]]
            bounds = np.cumsum([0] + [n // self.p + (j < n % self.p) for j in range(self.p)])
            chunks = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
            got = self.plans[key] = bufs, chunks
        return got

    def call(self, comm, x: np.ndarray, op: str):
        """``shm_all_reduce`` of a NumPy ``x`` when nothing watches the call (no debug mode, no
        tracing, no outer collective): what ``collective`` does around it, leanly -- count the call,
        stamp it, note it for the watchdog, record it in the ledger -- around ``reduce``."""
        kind = self.kinds.get((op, x.dtype))
        if kind is None:                             # checked once per (op, dtype): the stamp's bits
            check_op(comm, op, x.dtype)
            kind = self.kinds[op, x.dtype] = stamp(NAME, 0, x.dtype, op, None)
        comm.seq = seq = comm.seq + 1
        comm.origin.last_op = (NAME, seq)            # (comm.note, inlined)
        flat = x if x.ndim == 1 else x.reshape(-1)
        tag = ((seq & 0xFF) << 12) | kind
        if flat.nbytes <= self.cap:                  # one piece (reduce's first case, inlined)
            out, sent, received, steps = self.piece(comm, tag, flat, None, OPS[op], flat.nbytes)
        else:
            out, sent, received, steps = self.reduce(comm, tag, flat, op)
        comm.ledger.count_call(NAME, sent, received, steps)
        if op == "mean":
            out /= self.p
        return out if x.ndim == 1 else out.reshape(x.shape)

    def reduce(self, comm, tag: int, src: np.ndarray, op: str) -> tuple:
        """Every rank's flat ``src`` reduced, in pieces that fit the window: (result, bytes this rank
        wrote into the window, bytes it read from the others', steps)."""
        fn, step = OPS[op], max(1, self.cap // src.itemsize)
        if src.size <= step:
            return self.piece(comm, tag, src, None, fn, src.nbytes)
        out, sent, received, steps = np.empty_like(src), 0, 0, 0
        for lo in range(0, src.size, step):
            _, s, r, n = self.piece(comm, tag, src[lo:lo + step], out[lo:lo + step], fn, src.nbytes)
            sent, received, steps = sent + s, received + r, steps + n
        return out, sent, received, steps

    def piece(self, comm, tag: int, src: np.ndarray, out, fn, nbytes: int) -> tuple:
        """One call of the protocol on one piece (module docstring): as ``reduce``. ``out``: where to
        put the result (None: a new array). ``nbytes``: the whole call's size, posted and checked."""
        self.calls = call = self.calls + 1
        parity, r, heads = call & 1, self.rank, self.heads
        bufs, chunks = self.plans.get((parity, src.dtype, src.size)) or self.plan(parity, src.dtype, src.size)
        bufs[r][...] = src
        me = heads[r]
        me[CALL + parity] = what = tag | nbytes << TAG_BITS
        fence = self.fence
        if fence is not None:
            fence()                       # the data before the number (x86 keeps stores in order)
        me[SEQ] = call
        for j in self.others:
            h = heads[j]
            if h[SEQ] < call:
                self.wait(comm, tag, j, SEQ, call)
            if fence is not None:
                fence()                   # the number before the data
            if h[CALL + parity] != what:
                raise self.mismatch(comm, j, h[CALL + parity], tag, nbytes)
        if src.nbytes < self.two_shot_from:               # one-shot: everyone adds up everything
            out = fn(bufs[0], bufs[1], out=out)
            for b in bufs[2:]:
                fn(out, b, out=out)
            return out, src.nbytes, (self.p - 1) * src.nbytes, 1
        if out is None:
            out = np.empty_like(src)
        mine = chunks[r]                                  # two-shot: my chunk of everyone's buffer ...
        fn(bufs[0][mine], bufs[1][mine], out=out[mine])
        for b in bufs[2:]:
            fn(out[mine], b[mine], out=out[mine])
        bufs[r][mine] = out[mine]                         # ... back into my buffer, for the others
        if fence is not None:
            fence()
        me[SEQ2] = call
        for j in self.others:
            if heads[j][SEQ2] < call:
                self.wait(comm, tag, j, SEQ2, call)
        if fence is not None:
            fence()
        for j in self.others:                             # then everyone's reduced chunk
            out[chunks[j]] = bufs[j][chunks[j]]
        part = out[mine].nbytes
        return out, src.nbytes + part, (self.p - 1) * part + src.nbytes - part, 2

    def wait(self, comm, tag: int, j: int, word: int, call: int) -> None:
        """Until rank ``j``'s header word ``word`` reaches ``call``, through ``poll``: spin with
        ``sched_yield``, then sleep; the "still waiting" line and the watchdog; a peer that returned
        from run() or whose next message belongs to another collective raises at once."""
        h = self.heads[j]
        phase = " (two-shot's second phase)" if word == SEQ2 else ""
        problem = getattr(comm.channel("coll"), "peer_problem", None)  # (MPI's; tests run lanes on threads)
        poll(lambda: h[word] >= call, comm, lambda: f"rank {j} to post its part of {NAME} (piece "
             f"#{call} on this communicator{phase})", problem and (lambda: problem(j, tag)))

    def mismatch(self, comm, j: int, what: int, tag: int, nbytes: int) -> Exception:
        """Rank ``j`` posted ``what``: another call (stamp) or another size than this rank's."""
        if what & ((1 << TAG_BITS) - 1) != tag:
            return stamp_mismatch(comm, j, tag, what & ((1 << TAG_BITS) - 1))
        return MessageMismatch(f"rank {self.rank} of {self.p} (mpi), in {NAME} #{comm.seq}: rank {j} "
                               f"all-reduces {what >> TAG_BITS} bytes, this rank {nbytes}: the ranks "
                               f"disagree on the size")


class Window:
    """The shared window of one communicator: ``LANES`` lanes of (header + 2 parity buffers) per rank."""

    def __init__(self, comm, node, cap: int, crowded: bool):
        from mpi4py import MPI

        lane_bytes = HEADER + 2 * cap
        self.node = node
        self.win = MPI.Win.Allocate_shared(LANES * lane_bytes, 1, comm=node)
        self.win.Lock_all(MPI.MODE_NOCHECK)              # a passive epoch, so Sync() is a memory fence
        slots = [np.frombuffer(self.win.Shared_query(j)[0], np.uint8) for j in range(node.Get_size())]
        # headers start at call 0 (never posted); buffers stay untouched until used: /dev/shm gives
        # a page on its first write, so an unused lane (or the part beyond small calls) costs nothing
        for i in range(LANES):
            slots[node.Get_rank()][i * lane_bytes:i * lane_bytes + HEADER] = 0
        self.win.Sync()
        node.Barrier()                                   # (every rank is here: attach's barrier)
        fence = None if platform.machine() in ("x86_64", "AMD64") else self.win.Sync  # x86: stores in order
        two_from = shm_two_shot_from(comm.size)
        self.lanes = [Lane([s[i * lane_bytes:(i + 1) * lane_bytes] for s in slots], cap, comm.rank, fence,
                           two_from, crowded) for i in range(LANES)]
        _windows.append(self)

    def free(self) -> None:
        """Collective over the node's ranks; afterwards no lane may be used."""
        if self.win is not None:
            self.win.Unlock_all()
            self.win.Free()
            self.node.Free()
            self.win = None


def attach(comm):
    """A ``Window`` for ``comm`` (an ``MPIComm`` that is its own origin), or None where shared memory
    can't serve it: its ranks span several nodes, a slow link is emulated (``MINIDIST_LINK``),
    /dev/shm has little room, or ``MINIDIST_SHM=0``. Collective over ``comm``; the ranks agree on
    the answer, the window's size and whether they outnumber the cores (shm at any size or not)."""
    from mpi4py import MPI

    comm.note("all_reduce(shm): allocating the shared window")   # what the watchdog shows meanwhile
    comm.channel("debug").barrier()  # watchdog-protected: every rank is here, so MPI's calls below can't hang
    node = comm.mpi.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    cap = comm.mpi.allreduce(window_bytes(comm.size), op=MPI.MIN)
    usable = (node.Get_size() == comm.size and comm.link is None and comm.clock is None and cap > 0
              and os.environ.get("MINIDIST_SHM", "1") not in ("0", "false", "False"))
    if not comm.mpi.allreduce(usable, op=MPI.LAND):
        node.Free()
        return None
    return Window(comm, node, cap, comm.mpi.allreduce(cost.crowded(), op=MPI.LOR))


def shm_lane(comm):
    """``comm``'s lane of its shared window (allocated collectively the first time), or False where
    shared memory can't serve it (another transport, one rank, several nodes, an emulated link)."""
    lane = getattr(comm, "shm", False)
    if lane is not None:
        return lane
    if comm.size == 1:
        comm.shm = False
        return False
    origin = comm.origin
    with _lock:
        if origin.shm is None:
            window = attach(origin)
            origin.shm = window.lanes[0] if window else False
            origin.shm_window = window
    window = origin.shm_window
    if comm is not origin:
        comm.shm = window.lanes[1] if window and comm is origin.channels.get("async") else False
    return comm.shm


def free_windows() -> None:
    """Free every window, in the order they were allocated (collective: after ``run()``'s end
    handshake every rank is here). Without it MPI_Finalize still ends cleanly; this returns the
    shared memory before that."""
    while _windows:
        _windows.pop(0).free()


def shm_all_reduce(comm, x, op: str = "sum"):
    """Through the node's shared memory, no messages (MPI transport, every rank on one node).

    Each rank copies x into its part of a shared window and posts the call; once every rank has
    posted, each adds up all ranks' buffers in rank order (one-shot), or, for large messages, its
    own chunk of them, which the others then copy (two-shot). Elsewhere (threads, JAX devices,
    ranks on several nodes, an emulated slow link) the algorithm the cost model picks for ``auto``.
    """
    lane = getattr(comm, "shm", False)
    if lane is None:                             # MPI, first time: the window's handshake
        cost.check_before_handshake(comm, x, op, "shm")
        lane = shm_lane(comm)
    if not lane and comm.size > 1:
        return ALGORITHMS[cost.choose_algorithm(x.nbytes, comm.size, cost.agreed_crowded(comm))](comm, x, op)
    if lane and type(x) is np.ndarray and unwatched(comm):  # (NumPy in, NumPy out, on any backend)
        return lane.call(comm, x, op)            # the same, with collective()'s work done leanly
    with collective(comm, "shm_all_reduce", x, op=op) as k:
        if not lane:
            return k.result(k.flat.copy())       # one rank: nothing to add
        out, sent, received, steps = lane.reduce(comm, k.tag, k.flat, op)
        comm.ledger.count_sendrecv(sent, received)
        k.step(steps)
        return k.result(out)


ALGORITHMS["shm"] = shm_all_reduce
