"""The MPI transport: ranks are MPI processes (``mpirun -n 8 python ...``, or several hosts).

Arrays travel through mpi4py's buffer API (``Isend``/``Irecv`` on the NumPy memory: zero copy).
JAX and CuPy arrays arrive here already staged to host memory by ``Communicator``.
A message with a header is two MPI messages: a small int64 header (ndim, dtype name, shape) on
tag ``2*tag`` and the payload on tag ``2*tag+1``; raw buffers (``send_buffer``) are only the
payload. Receives with headers post their payload ``Irecv`` strictly in the order they were
posted, so several pending receives from one peer still match the right messages.

Every wait is ``Test`` + sleep with backoff (see ``communicator.poll``): eight ranks waiting on
two cores leave the CPU to whoever computes, and the watchdog can fire. While it sleeps, a wait
also checks its peer: a peer that has returned from ``run()`` (it sent ``DONE_TAG`` on
COMM_WORLD, see launch.py) raises :class:`RankExited`; on a strict private channel, a peer whose next message
carries another collective's stamp raises :class:`CollectiveMismatch` (see debug.py). Every
receive checks the size of what arrived (MPI's status), so a mismatch is an error, not garbage.
"""

from __future__ import annotations

import collections
import time

import numpy as np

from minidist.comm.communicator import Communicator, MessageMismatch, RankExited, Request, format_op, poll
from minidist.comm.debug import stamp_mismatch
from minidist.comm.ledger import Ledger
from minidist.comm.transports.shm import free_windows

MAX_NDIM = 32
NAMESPACE = 1 << 21            # tags per private channel: user tags < 2**20, then minidist's object tags
TWINS = {"coll": 1, "debug": 2, "async": 3}
HEADER_LEN = 4 + MAX_NDIM      # ndim, 3 words of dtype name (24 chars), shape


_MPI = None


def _mpi():
    global _MPI
    if _MPI is None:
        from mpi4py import MPI

        _MPI = MPI
    return _MPI


def encode_header(buf: np.ndarray) -> np.ndarray:
    name = buf.dtype.name.encode()
    if buf.ndim > MAX_NDIM or len(name) > 24:
        raise ValueError(f"cannot send {buf.dtype}{list(buf.shape)}: at most {MAX_NDIM} dims")
    h = np.zeros(HEADER_LEN, np.int64)
    h[0] = buf.ndim
    h[1:4] = np.frombuffer(name.ljust(24, b"\0"), np.int64)
    h[4:4 + buf.ndim] = buf.shape
    return h


def decode_header(h: np.ndarray):
    name = h[1:4].tobytes().rstrip(b"\0").decode()
    try:
        dtype = np.dtype(name)
    except TypeError:
        import ml_dtypes

        dtype = np.dtype(getattr(ml_dtypes, name))
    return tuple(int(s) for s in h[4:4 + int(h[0])]), dtype


_NATIVE = set("?bBhHiIlLqQefdgFDG")  # dtypes mpi4py maps to MPI types itself


_KNOWN: dict = {}  # dtype -> mpi_knows(dtype): asked for every message, answered once per dtype


def mpi_knows(dtype) -> bool:
    """Does mpi4py map this dtype to an MPI type (so MPI itself can reduce it)?"""
    known = _KNOWN.get(dtype)
    if known is None:
        d = np.dtype(dtype)
        known = _KNOWN[dtype] = d.char in _NATIVE and d.isnative
    return known


def _bytes(buf: np.ndarray):
    """The buffer as MPI sees it: the array itself for standard dtypes, else its bytes (bfloat16)."""
    if mpi_knows(buf.dtype):
        return buf
    return buf.reshape(-1).view(np.uint8)


def _truncated(comm, source, tag, nbytes, error) -> Exception:
    """MPI's truncation error (a message larger than the buffer), in words; other errors as they are."""
    MPI = _mpi()
    if error.Get_error_class() not in (MPI.ERR_TRUNCATE, MPI.ERR_IN_STATUS):
        return error
    return MessageMismatch(f"rank {comm.rank}: a message from rank {source} (tag {tag}) is larger than the "
                           f"{nbytes}-byte buffer posted for it: the ranks disagree on the size ({error})")


def _check_count(comm, status, source, tag, nbytes) -> None:
    got = status.Get_count(_mpi().BYTE)
    if got != nbytes:
        raise MessageMismatch(f"rank {comm.rank}: received {got} bytes from rank {source} (tag {tag}) into "
                              f"a buffer of {nbytes} bytes: the ranks disagree on the size")


class _MPIRequest(Request):
    """A raw send, or a raw receive (``out`` given: its size is checked when it completes)."""

    def __init__(self, comm, reqs, keep, what, peer, tag, out=None):
        self.comm, self.reqs, self.keep, self.what = comm, reqs, keep, what
        self.peer, self.tag, self.out = peer, tag, out
        self.status = _mpi().Status() if out is not None else None
        self.done = False

    def test(self) -> bool:
        if self.done:
            return True
        if self.out is None:
            self.done = _mpi().Request.Testall(self.reqs)
            return self.done
        try:
            self.done = self.reqs[0].Test(self.status)
        except _mpi().Exception as e:
            raise _truncated(self.comm, self.peer, self.tag, self.out.nbytes, e) from None
        if self.done:
            _check_count(self.comm, self.status, self.peer, self.tag, _bytes(self.out).nbytes)
        return self.done

    def problem(self):
        return self.comm.peer_problem(self.peer, self.tag, self.out is not None)

    def wait(self):
        poll(self.test, self.comm, self.what, self.problem)
        return self.out


def _drain(pending: dict, key) -> None:
    """Post the payload receives of this (source, tag)'s pending receives whose header arrived, in
    the order they were posted; forget the (source, tag) once none is pending (every collective
    call has its own tag: the table must not grow with the calls)."""
    queue = pending.get(key)
    while queue and queue[0].hreq.Test():
        queue.popleft()._post_payload()
    if queue is not None and not queue:
        del pending[key]


class _MPIHeaderRecv(Request):
    """Receive a header, then post the payload receive (in posted order per (source, tag))."""

    def __init__(self, comm: MPIComm, source, tag, out, count):
        self.comm, self.source, self.tag, self.out, self.count = comm, source, tag, out, count
        self.h = np.empty(HEADER_LEN, np.int64)
        self.hreq = comm.mpi.Irecv(self.h, source, comm.base + 2 * tag)
        self.preq = None
        comm._pending.setdefault((source, tag), collections.deque()).append(self)

    def _post_payload(self):
        shape, dtype = decode_header(self.h)
        c = self.comm
        if self.out is None:
            self.out = np.empty(shape, dtype)
        elif self.out.shape != shape or self.out.dtype != dtype:
            raise MessageMismatch(f"rank {c.rank}: received {dtype}{list(shape)} from rank {self.source} "
                                  f"into a buffer of {self.out.dtype}{list(self.out.shape)}")
        self.preq = c.mpi.Irecv(_bytes(self.out), self.source, c.base + 2 * self.tag + 1)

    def test(self) -> bool:
        if self.preq is None:
            _drain(self.comm._pending, (self.source, self.tag))
            if self.preq is None:
                return False
        return self.preq.Test()

    def problem(self):
        return self.comm.peer_problem(self.source, self.tag)

    def wait(self):
        poll(self.test, self.comm, f"a message from rank {self.source} (tag {self.tag})", self.problem)
        if self.count:
            self.comm.ledger.count_recv(self.out.nbytes)
            self.count = False
        return self.out


class MPIComm(Communicator):
    """One MPI process's end of an ``mpi4py`` communicator (``MPI.COMM_WORLD`` by default)."""

    transport = "mpi"

    def __init__(self, mpicomm=None, backend=None, ledger: Ledger | None = None, namespace: int = 0):
        self.mpi = mpicomm if mpicomm is not None else _mpi().COMM_WORLD
        super().__init__(self.mpi.Get_rank(), self.mpi.Get_size(), backend, ledger)
        self.namespace = namespace
        self.base = 2 * namespace * NAMESPACE  # MPI tag of (tag, header) = base + 2*tag; payload +1
        self._pending: dict = {}  # (source, tag) -> header receives waiting for their payload, in order
        self._statuses = [_mpi().Status(), _mpi().Status()]  # the hot path's: reused, looked up once
        self._testall, self._BYTE = _MPI.Request.Testall, _MPI.BYTE
        self._world_ranks: list | None = None
        self.shm = None         # this communicator's lane of a shared window: None = not asked yet (shm.py)
        self.shm_window = None  # the origin's shm.Window, or None where shared memory can't serve it

    def progress(self) -> None:
        """Post the payload receive of every pending receive whose header has arrived.

        Called from every wait: a rank blocked in its own send must still take in a large message
        sent to it, or two ranks exchanging large messages would each wait for the other.
        """
        if self._pending:
            for key in list(self._pending):
                _drain(self._pending, key)

    # -- checks while waiting (slow path only) -----------------------------------------------------
    def world_rank(self, r: int) -> int:
        if self._world_ranks is None:
            MPI = _mpi()
            self._world_ranks = MPI.Group.Translate_ranks(self.mpi.Get_group(), list(range(self.size)),
                                                         MPI.COMM_WORLD.Get_group())
        return self._world_ranks[r]

    def peer_problem(self, peer: int, tag: int, receiving: bool = True):
        """Why ``peer`` may never answer, or None: it has returned from run(), or (strict channel,
        receiving) its next message belongs to another collective call."""
        MPI = _mpi()
        if MPI.COMM_WORLD.Iprobe(self.world_rank(peer), done_tag()):
            return RankExited(f"rank {self.rank} of {self.size} (mpi), in {format_op(self.origin.last_op)}: "
                              f"rank {peer} returned from run() without sending or receiving what this "
                              f"rank waits for (tag {tag})")
        if self.strict and receiving:
            status = MPI.Status()
            if self.mpi.Iprobe(peer, MPI.ANY_TAG, status):
                ns, t = divmod(status.Get_tag(), 2 * NAMESPACE)
                if ns == self.namespace and t // 2 != tag:
                    return stamp_mismatch(self, peer, tag, t // 2)
        return None

    # -- the transport interface ---------------------------------------------------------------
    def isend_buffer(self, buf, dest, tag=0, *, header=False, count=True) -> Request:
        if self.link is not None:
            self.link.pause(buf.nbytes)  # the emulated link is busy for alpha + bytes / bandwidth
        reqs, keep = [], [buf]
        if header:
            h = encode_header(buf)
            keep.append(h)
            reqs.append(self.mpi.Isend(h, dest, self.base + 2 * tag))
            self.ledger.count_header(h.nbytes)
        reqs.append(self.mpi.Isend(_bytes(buf), dest, self.base + 2 * tag + 1))
        if count:
            self.ledger.count_send(buf.nbytes)
        return _MPIRequest(self, reqs, keep, f"a send to rank {dest} (tag {tag}) to complete", dest, tag)

    def irecv_buffer(self, out, source, tag=0, *, header=False, count=True) -> Request:
        if header:
            return _MPIHeaderRecv(self, source, tag, out, count)
        if count:
            self.ledger.count_recv(out.nbytes)
        req = self.mpi.Irecv(_bytes(out), source, self.base + 2 * tag + 1)
        return _MPIRequest(self, [req], [out], f"a message from rank {source} (tag {tag})", source, tag, out)

    def sendrecv_buffer(self, sendbuf, dest, recvbuf, source, tag=0, *, header=False):
        """The hot path of every ring and butterfly: one Irecv, one Isend, one wait on both; the
        size of what arrived is checked from MPI's status."""
        if header:
            return super().sendrecv_buffer(sendbuf, dest, recvbuf, source, tag, header=True)
        if self.link is not None:
            self.link.pause(sendbuf.nbytes)
        t = self.base + 2 * tag + 1
        reqs = [self.mpi.Irecv(_bytes(recvbuf), source, t), self.mpi.Isend(_bytes(sendbuf), dest, t)]
        self.ledger.count_sendrecv(sendbuf.nbytes, recvbuf.nbytes)
        statuses, testall = self._statuses, self._testall
        try:
            if not testall(reqs, statuses):  # (already done: no closures to build)
                poll(lambda: testall(reqs, statuses), self, lambda: f"sendrecv: to {dest}, from {source}",
                     lambda: self.peer_problem(source, tag))
        except _MPI.Exception as e:
            raise _truncated(self, source, tag, recvbuf.nbytes, e) from None
        if statuses[0].Get_count(self._BYTE) != recvbuf.nbytes:
            _check_count(self, statuses[0], source, tag, recvbuf.nbytes)
        return recvbuf

    def make_twin(self, name: str) -> MPIComm:
        """A private channel on the same MPI communicator with its own range of tags (no MPI call, so it can't
        hang); MPI's ``Dup`` only if the tag range would pass the MPI library's TAG_UB."""
        ns = self.namespace * 4 + TWINS.get(name, 3)
        if 2 * (ns + 1) * NAMESPACE <= self.mpi.Get_attr(_mpi().TAG_UB):
            return MPIComm(self.mpi, self.backend, self.ledger, ns)
        self.note(f"creating the private communicator {name!r}")
        self.barrier()  # our barrier has the watchdog; MPI's Dup would wait forever for a missing rank
        return MPIComm(self.mpi.Dup(), self.backend, self.ledger)

    def split(self, color, key=0):
        MPI = _mpi()
        self.note(f"split(color={color}, key={key})")
        self.barrier()  # everyone is here (watchdog-protected), so MPI's Split can't hang
        new = self.mpi.Split(MPI.UNDEFINED if color is None or color < 0 else color, key)
        if new == MPI.COMM_NULL:
            return None
        return MPIComm(new, self.backend, Ledger(parent=self.ledger))


# -- the completion handshake (launch.py): every rank tells every other that it has finished --------

_DONE_TAG: list = []


def done_tag() -> int:
    """A tag no namespace uses: TAG_UB itself (namespaces end below it, see ``make_twin``)."""
    if not _DONE_TAG:
        _DONE_TAG.append(_mpi().COMM_WORLD.Get_attr(_mpi().TAG_UB))
    return _DONE_TAG[0]


def finish_handshake(comm: MPIComm) -> None:
    """Tell every other rank of COMM_WORLD that this one has returned from its function (a peer
    still waiting for it raises ``RankExited`` at once), then wait until every rank has said so.
    No timeout: a peer may legitimately compute long after us; a dead peer ends the job (mpirun)."""
    MPI = _mpi()
    world, token = MPI.COMM_WORLD, np.zeros(0, np.uint8)
    peers = [r for r in range(world.Get_size()) if r != world.Get_rank()]
    tag = done_tag()
    reqs = [world.Isend(token, r, tag) for r in peers]
    reqs += [world.Irecv(np.zeros(0, np.uint8), r, tag) for r in peers]
    comm.note("finished: waiting for the other ranks to finish run()")
    delay = 1e-4
    while not MPI.Request.Testall(reqs):
        time.sleep(delay)
        delay = min(2 * delay, 0.05)
    free_windows()  # collective, and every rank has finished: nobody uses a window any more
