"""The MPI transport: ranks are MPI processes (``mpirun -n 8 python ...``, or several hosts).

Arrays travel through mpi4py's buffer API (``Isend``/``Irecv`` on the NumPy memory: zero copy).
JAX and CuPy arrays arrive here already staged to host memory by ``Communicator``.
A message with a header is two MPI messages: a small int64 header (ndim, dtype name, shape) on
tag ``2*tag`` and the payload on tag ``2*tag+1``; raw buffers (``send_buffer``) are only the
payload. Receives with headers post their payload ``Irecv`` strictly in the order they were
posted, so several pending receives from one peer still match the right messages.

Every wait is ``Test`` + sleep with backoff (see ``communicator.poll``): eight ranks waiting on
two cores leave the CPU to whoever computes, and the watchdog can fire.
"""

from __future__ import annotations

import collections

import numpy as np

from minidist.comm.communicator import Communicator, Request, poll
from minidist.comm.ledger import Ledger

MAX_NDIM = 32
NAMESPACE = 1 << 21            # tags per twin: user tags < 2**20, then minidist's object tags
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


def mpi_knows(dtype) -> bool:
    """Does mpi4py map this dtype to an MPI type (so MPI itself can reduce it)?"""
    dtype = np.dtype(dtype)
    return dtype.char in _NATIVE and dtype.isnative


def _bytes(buf: np.ndarray):
    """The buffer as MPI sees it: the array itself for standard dtypes, else its bytes (bfloat16)."""
    if mpi_knows(buf.dtype):
        return buf
    return buf.reshape(-1).view(np.uint8)


class _MPIRequest(Request):
    def __init__(self, comm, reqs, keep, what, result=None):
        self.comm, self.reqs, self.keep, self.what, self.result = comm, reqs, keep, what, result

    def test(self) -> bool:
        return _mpi().Request.Testall(self.reqs)

    def wait(self):
        poll(self.test, self.comm, self.what)
        return self.result


def _drain(queue) -> None:
    """Post the payload receives of this (source, tag)'s pending receives whose header arrived, in
    the order they were posted."""
    while queue and queue[0].hreq.Test():
        queue.popleft()._post_payload()


class _MPIHeaderRecv(Request):
    """Receive a header, then post the payload receive (in posted order per (source, tag))."""

    def __init__(self, comm: MPIComm, source, tag, out, count):
        self.comm, self.source, self.tag, self.out, self.count = comm, source, tag, out, count
        self.h = np.empty(HEADER_LEN, np.int64)
        self.hreq = comm.mpi.Irecv(self.h, source, comm.base + 2 * tag)
        self.preq = None
        self.queue = comm._pending[(source, tag)]
        self.queue.append(self)

    def _post_payload(self):
        shape, dtype = decode_header(self.h)
        c = self.comm
        if self.out is None:
            self.out = np.empty(shape, dtype)
        elif self.out.shape != shape or self.out.dtype != dtype:
            raise ValueError(f"rank {c.rank}: received {dtype}{list(shape)} from rank {self.source} "
                             f"into a buffer of {self.out.dtype}{list(self.out.shape)}")
        self.preq = c.mpi.Irecv(_bytes(self.out), self.source, c.base + 2 * self.tag + 1)

    def test(self) -> bool:
        if self.preq is None:
            _drain(self.queue)
            if self.preq is None:
                return False
        return self.preq.Test()

    def wait(self):
        poll(self.test, self.comm, f"a message from rank {self.source} (tag {self.tag})")
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
        self._pending: dict = collections.defaultdict(collections.deque)

    def progress(self) -> None:
        """Post the payload receive of every pending receive whose header has arrived.

        Called from every wait: a rank blocked in its own send must still take in a large message
        sent to it, or two ranks exchanging large messages would each wait for the other.
        """
        for queue in self._pending.values():
            _drain(queue)

    def _isend_host(self, buf, dest, tag, header, count=True) -> Request:
        reqs, keep = [], [buf]
        if header:
            h = encode_header(buf)
            keep.append(h)
            reqs.append(self.mpi.Isend(h, dest, self.base + 2 * tag))
            self.ledger.count_header(h.nbytes)
        reqs.append(self.mpi.Isend(_bytes(buf), dest, self.base + 2 * tag + 1))
        if count:
            self.ledger.count_send(buf.nbytes)
        return _MPIRequest(self, reqs, keep, f"a send to rank {dest} (tag {tag}) to complete")

    def _irecv_host(self, source, tag, out, header, count=True) -> Request:
        if header:
            return _MPIHeaderRecv(self, source, tag, out, count)
        if count:
            self.ledger.count_recv(out.nbytes)
        req = self.mpi.Irecv(_bytes(out), source, self.base + 2 * tag + 1)
        return _MPIRequest(self, [req], [out], f"a message from rank {source} (tag {tag})", out)

    def sendrecv_buffer(self, sendbuf, dest, recvbuf, source, tag=0):
        """The hot path of every ring and butterfly: one Irecv, one Isend, one wait on both."""
        t = self.base + 2 * tag + 1
        reqs = [self.mpi.Irecv(_bytes(recvbuf), source, t), self.mpi.Isend(_bytes(sendbuf), dest, t)]
        self.ledger.count_sendrecv(sendbuf.nbytes, recvbuf.nbytes)
        testall = _mpi().Request.Testall
        poll(lambda: testall(reqs), self, lambda: f"sendrecv: to rank {dest}, from rank {source}")
        return recvbuf

    def _dup(self, name: str) -> MPIComm:
        """A twin on the same MPI communicator with its own range of tags (no MPI call, so it can't
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
