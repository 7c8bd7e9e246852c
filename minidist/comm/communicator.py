"""The Communicator: one rank's view of a group of ranks (principle 1 of DESIGN.md).

A transport (``ThreadComm``: ranks as threads; ``MPIComm``: ranks as MPI processes) implements
three host-buffer primitives -- ``_isend_host``, ``_irecv_host`` and ``split`` -- and this class
builds the whole public interface on them, the same for every transport:

* ``send / recv / isend / irecv / sendrecv``: arrays of any backend. The receiver learns shape and
  dtype from a small header message (not counted as payload in the ledger) unless ``out`` is given.
* ``send_buffer / recv_buffer / sendrecv_buffer``: NumPy host buffers whose shape both sides
  already know: no header, no allocation. Collectives use these (they always know the sizes).
* ``send_obj / recv_obj / bcast_obj / gather_obj / allgather_obj``: pickled Python objects, for
  small metadata only (counted as header bytes, not payload).

Every wait is bounded by ``comm.timeout`` (``MINIDIST_TIMEOUT`` seconds, default 300): a wait that
runs out raises :class:`CommTimeout` naming the waiting rank, its peer and each rank's last operation.
"""

from __future__ import annotations

import os
import pickle
import threading
import time

import numpy as np

from minidist.backend import backend_of, default_backend
from minidist.comm import tracing
from minidist.comm.ledger import Ledger, current_call

MAX_USER_TAG = 1 << 20          # user tags are 0 .. MAX_USER_TAG-1; larger ones are minidist's own
OBJ_TAG = MAX_USER_TAG + 1      # pickled-object messages: OBJ_TAG + 2*tag, tag < MAX_OBJ_TAG
MAX_OBJ_TAG = 1 << 18


class CommError(RuntimeError):
    """A communication failure that names the ranks involved."""


class CommTimeout(CommError, TimeoutError):
    """A wait ran past ``comm.timeout``: the watchdog's error."""


class RankAborted(CommError):
    """Raised on the other ranks when one rank failed (threads transport), so nobody hangs."""


def format_op(op) -> str:
    return op if isinstance(op, str) else f"{op[0]} #{op[1]}"


def default_timeout() -> float:
    return float(os.environ.get("MINIDIST_TIMEOUT", "300"))


def debug_enabled() -> bool:
    return os.environ.get("MINIDIST_DEBUG", "0") not in ("", "0", "false", "False")


class Request:
    """A pending send or receive. ``wait()`` returns the received array (None for a send)."""

    def test(self) -> bool:
        raise NotImplementedError

    def wait(self):
        raise NotImplementedError


class _Converted(Request):
    """Wraps a host-buffer request so ``wait()`` returns an array of the caller's backend."""

    def __init__(self, req: Request, convert):
        self._req, self._convert, self._done, self._value = req, convert, False, None

    def test(self) -> bool:
        return self._req.test()

    def wait(self):
        if not self._done:
            self._value = self._convert(self._req.wait())
            self._done = True
        return self._value


class Communicator:
    """Abstract base: a group of ``size`` ranks; this object is rank ``rank``'s end of it."""

    transport = "abstract"

    def __init__(self, rank: int, size: int, backend=None, ledger: Ledger | None = None):
        self.rank, self.size = rank, size
        self.backend = backend if backend is not None else default_backend()
        self.ledger = ledger if ledger is not None else Ledger()
        self._derived: dict = {}        # private twins (same group, own tag space), see derived()
        self.timeout = default_timeout()
        self.debug = debug_enabled()
        self.seq = 0                    # collectives called on this communicator so far
        self.last_op = "start"
        self.async_worker = None        # the thread that runs this communicator's async collectives

    # -- what a transport implements ----------------------------------------------------------
    def _isend_host(self, buf: np.ndarray, dest: int, tag: int, header: bool, count: bool = True) -> Request:
        raise NotImplementedError

    def _irecv_host(self, source: int, tag: int, out: np.ndarray | None, header: bool,
                    count: bool = True) -> Request:
        raise NotImplementedError

    def split(self, color: int | None, key: int = 0) -> Communicator | None:
        """Like ``MPI_Comm_split``: ranks with equal ``color`` form a group ordered by (key, rank).

        Collective over this communicator. ``color=None`` (or negative) joins no group: returns None.
        """
        raise NotImplementedError

    def _dup(self, name: str) -> Communicator:
        raise NotImplementedError

    def ranks_status(self) -> str:
        """Each rank's last operation, as far as this rank can know (threads: all; MPI: its own)."""
        return f"rank {self.rank}: {format_op(self.last_op)}"

    # -- helpers ------------------------------------------------------------------------------
    def derived(self, name: str) -> Communicator:
        """A private twin of this communicator (same ranks, separate messages): collective."""
        if name not in self._derived:
            twin = self._dup(name)
            twin.timeout = self.timeout
            self._derived[name] = twin
        return self._derived[name]

    @property
    def timeout(self) -> float:
        """Seconds any wait on this communicator (or its private twins) may take: the watchdog."""
        return self._timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._timeout = seconds
        for twin in self._derived.values():
            twin.timeout = seconds

    def note(self, op) -> None:
        """Record this rank's current operation (shown by the watchdog): a string, or a tuple
        (collective name, sequence number) formatted only when shown -- notes must be cheap."""
        self.last_op = op

    def _check_peer(self, peer: int, what: str) -> int:
        if not isinstance(peer, (int, np.integer)) or not 0 <= peer < self.size:
            raise ValueError(f"rank {self.rank}: {what}={peer!r} is not a rank of this communicator "
                             f"(valid: 0..{self.size - 1})")
        return int(peer)

    def _check_tag(self, tag: int) -> int:
        if not 0 <= tag < MAX_USER_TAG:
            raise ValueError(f"rank {self.rank}: tag={tag} must be in 0..{MAX_USER_TAG - 1}")
        return tag

    def timeout_error(self, what: str, waited: float) -> CommTimeout:
        return CommTimeout(
            f"watchdog: rank {self.rank} of {self.size} ({self.transport}) waited {waited:.1f} s "
            f"(timeout {self.timeout:g} s, MINIDIST_TIMEOUT) for {what}.\nLast operation of each rank:\n  "
            + self.ranks_status().replace("\n", "\n  "))

    # -- arrays -------------------------------------------------------------------------------
    def isend(self, x, dest: int, tag: int = 0) -> Request:
        dest, tag = self._check_peer(dest, "dest"), self._check_tag(tag)
        host = np.ascontiguousarray(backend_of(x).to_host(x))
        self.note(f"send to {dest} tag {tag}")
        return self._isend_host(host, dest, tag, header=True)

    def send(self, x, dest: int, tag: int = 0) -> None:
        with tracing.span(f"send->{dest}", "send"):
            self.isend(x, dest, tag).wait()

    def irecv(self, source: int, tag: int = 0, out=None) -> Request:
        source, tag = self._check_peer(source, "source"), self._check_tag(tag)
        self.note(f"recv from {source} tag {tag}")
        if out is not None and isinstance(out, np.ndarray):
            if not out.flags.c_contiguous:
                raise ValueError(f"rank {self.rank}: recv out= must be C-contiguous")
            return self._irecv_host(source, tag, out, header=True)
        if out is None:
            return _Converted(self._irecv_host(source, tag, None, header=True), self.backend.from_host)
        be = backend_of(out)  # CuPy: staged through host memory, then copied into out; JAX: a new array
        return _Converted(self._irecv_host(source, tag, None, header=True),
                          lambda a: be.update(out, be.from_host(a)))

    def recv(self, source: int, tag: int = 0, out=None):
        with tracing.span(f"recv<-{source}", "recv"):
            return self.irecv(source, tag, out).wait()

    def sendrecv(self, x, dest: int, source: int, sendtag: int = 0, recvtag: int = 0, out=None):
        r = self.irecv(source, recvtag, out)
        s = self.isend(x, dest, sendtag)
        with tracing.span(f"sendrecv->{dest}<-{source}", "wait"):
            s.wait()
            return r.wait()

    # -- raw host buffers (both sides know the shape): what collectives use ---------------------
    def send_buffer(self, buf: np.ndarray, dest: int, tag: int = 0) -> None:
        self._isend_host(buf, dest, tag, header=False).wait()

    def recv_buffer(self, buf: np.ndarray, source: int, tag: int = 0) -> np.ndarray:
        return self._irecv_host(source, tag, buf, header=False).wait()

    def sendrecv_buffer(self, sendbuf: np.ndarray, dest: int, recvbuf: np.ndarray, source: int,
                        tag: int = 0) -> np.ndarray:
        """Send ``sendbuf`` to ``dest`` while receiving into ``recvbuf`` from ``source`` (no deadlock)."""
        return self._sendrecv_host(sendbuf, dest, source, tag, out=recvbuf, header=False)

    def _sendrecv_host(self, sendbuf, dest, source, tag, out=None, header=True) -> np.ndarray:
        """Post the receive, send (if ``sendbuf`` is not None), wait for both."""
        r = self._irecv_host(source, tag, out, header=header)
        if sendbuf is not None:
            self._isend_host(sendbuf, dest, tag, header=header).wait()
        return r.wait()

    def barrier(self) -> None:
        """Dissemination barrier: ceil(log2 p) rounds of empty messages."""
        self.note("barrier")
        token, got = np.zeros(0, np.uint8), np.zeros(0, np.uint8)
        k = 1
        while k < self.size:
            r = self._irecv_host((self.rank - k) % self.size, OBJ_TAG + 1, got, header=False, count=False)
            self._isend_host(token, (self.rank + k) % self.size, OBJ_TAG + 1, header=False,
                             count=False).wait()
            r.wait()
            k *= 2

    # -- small Python objects (pickled; counted as header bytes, not payload) -------------------
    def _check_obj_tag(self, tag: int) -> None:
        if not 0 <= tag < MAX_OBJ_TAG:
            raise ValueError(f"rank {self.rank}: object tag={tag} must be in 0..{MAX_OBJ_TAG - 1}")

    def send_obj(self, obj, dest: int, tag: int = 0) -> None:
        dest = self._check_peer(dest, "dest")
        self._check_obj_tag(tag)
        data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        self.ledger.count_header(data.nbytes)
        self._isend_host(data, dest, OBJ_TAG + 2 * tag, header=True, count=False).wait()

    def recv_obj(self, source: int, tag: int = 0):
        source = self._check_peer(source, "source")
        self._check_obj_tag(tag)
        data = self._irecv_host(source, OBJ_TAG + 2 * tag, None, header=True, count=False).wait()
        return pickle.loads(data.tobytes())

    def bcast_obj(self, obj, root: int = 0):
        root = self._check_peer(root, "root")
        if self.rank == root:
            for r in range(self.size):
                if r != root:
                    self.send_obj(obj, r)
            return obj
        return self.recv_obj(root)

    def gather_obj(self, obj, root: int = 0) -> list | None:
        root = self._check_peer(root, "root")
        if self.rank != root:
            self.send_obj(obj, root)
            return None
        return [obj if r == root else self.recv_obj(r) for r in range(self.size)]

    def allgather_obj(self, obj) -> list:
        return self.bcast_obj(self.gather_obj(obj, 0), 0)

    def close(self) -> None:
        """Stop the async worker of this communicator and of its private twins (if any)."""
        for c in [self, *self._derived.values()]:
            if c.async_worker is not None:
                c.async_worker.stop()
                c.async_worker = None

    def __repr__(self):
        return f"<{type(self).__name__} rank {self.rank} of {self.size}, {self.backend.name}>"


class WaitPolicy:
    """How a wait spends its time, in two phases (decided once per process, see ``wait_policy``):

    1. ``spin`` (``collective_spin`` inside a collective): test, then ``sched_yield``, so any other
       runnable rank gets the core -- spinning only uses time nobody else wants, and MPI moves a
       large message only while we poll. A collective's ranks are all active and answer soon, so
       inside one we spin longer.
    2. sleep with exponential backoff up to ``longest``: a rank waiting for a pipeline stage or a
       slow peer leaves the CPU to whoever computes (~60 us wake-up latency per message).
    """

    def __init__(self, spin: float, collective_spin: float, longest: float):
        self.spin, self.collective_spin, self.longest = spin, collective_spin, longest

    def __repr__(self):
        return "WaitPolicy(" + ", ".join(f"{k}={v * 1e6:g} us" for k, v in vars(self).items()) + ")"


_POLICY: list = []  # [WaitPolicy], decided once per process


def wait_policy() -> WaitPolicy:
    """The process's WaitPolicy. More ranks on this host than cores ("crowded"): spin 1 ms (5 ms in
    a collective), then sleep up to 1 ms. Otherwise spin 5 ms (20 ms), sleep up to 0.2 ms.
    ``MINIDIST_SPIN_US`` and ``MINIDIST_COLL_SPIN_US`` set the spin times."""
    if not _POLICY:
        from minidist.comm.cost import crowded as is_crowded

        crowded = is_crowded()

        def us(name, default):
            return float(os.environ.get(name, default)) * 1e-6

        _POLICY.append(WaitPolicy(spin=us("MINIDIST_SPIN_US", 1000 if crowded else 5000),
                                  collective_spin=us("MINIDIST_COLL_SPIN_US", 5000 if crowded else 20000),
                                  longest=1e-3 if crowded else 2e-4))
    return _POLICY[0]


_thread = threading.local()


def _fine_sleeps() -> None:
    """Linux rounds a thread's short sleeps up by its timer slack (50 us by default); set it to
    1 us for this thread, so a 20 us back-off sleep costs 20 us. Once per thread; harmless elsewhere."""
    _thread.fine = True
    if os.environ.get("MINIDIST_TIMERSLACK", "1") == "0":
        return
    try:
        import ctypes

        ctypes.CDLL(None).prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, nanoseconds
    except Exception:
        pass


def poll(test, comm: Communicator, what: str) -> None:
    """Wait until ``test()`` is true: spin with ``sched_yield``, then sleep with exponential backoff
    (see ``WaitPolicy``; a collective spins longer). Raises the watchdog's :class:`CommTimeout` after
    ``comm.timeout`` seconds."""
    progress = getattr(comm, "progress", None)  # MPI: post payload receives whose header arrived
    if progress is not None:
        progress()
    if test():
        return
    policy = wait_policy()
    if not getattr(_thread, "fine", False):
        _fine_sleeps()
    clock = time.monotonic
    start = clock()
    spin_until = start + (policy.collective_spin if current_call() is not None else policy.spin)
    delay, yield_ = 2e-5, os.sched_yield
    while not test():
        if progress is not None:
            progress()
        now = clock()
        if now < spin_until:
            yield_()
            continue
        if now - start > comm.timeout:
            raise comm.timeout_error(what() if callable(what) else what, now - start)
        time.sleep(delay)
        delay = min(delay * 2, policy.longest)
