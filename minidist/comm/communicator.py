"""The Communicator: one rank's view of a group of ranks.

Every algorithm is SPMD code for one rank with its communicator passed in (``ring_all_reduce(comm,
x)``); this class is that ``comm``. It is written once, on top of a small **transport interface**
that each transport implements in one file (threads.py: ranks as threads; mpi.py: ranks as MPI
processes). To add a transport, subclass ``Communicator`` and write these four methods:

* ``isend_buffer(buf, dest, tag=0, *, header=False, count=True) -> Request`` -- start sending the
  contiguous NumPy host buffer ``buf``. ``header=True``: the shape and dtype travel with it.
* ``irecv_buffer(out, source, tag=0, *, header=False, count=True) -> Request`` -- start receiving
  into ``out`` (``None`` allowed when ``header=True``: allocated from the header). A message of
  another size or dtype raises :class:`MessageMismatch`; ``wait()`` returns the array.
* ``split(color, key=0)`` -- like ``MPI_Comm_split``: new communicators for groups of ranks.
* ``make_twin(name)`` -- a communicator over the same ranks whose messages never match ours.

``count=False`` keeps a message out of the ledger's payload counts (objects, barriers). Waiting is
shared: a transport's ``Request`` (requests.py, with the errors) waits in ``poll`` (waiting.py), or,
like threads.py, in its own loop that raises the same errors. A *strict* communicator (the
private channel that collectives talk on) also checks, while it waits, that the peer's next message
belongs to the same collective call (see debug.py): a mismatch raises at once instead of hanging.

On these, this class builds the interface every algorithm uses, the same on every transport:

* ``send / recv / isend / irecv / sendrecv``: arrays of any backend. The receiver learns shape and
  dtype from a small header message (not counted as payload in the ledger) unless ``out`` is given.
* ``send_buffer / recv_buffer / sendrecv_buffer``: NumPy host buffers. Collectives use these; with
  ``header=False`` (both sides know the size) no header travels and nothing is allocated.
* ``send_obj / recv_obj / bcast_obj / gather_obj / allgather_obj``: pickled Python objects, for
  small metadata only (counted as header bytes, not payload).
* ``twin(name)``: a private channel (same ranks, own messages), e.g. ``twin("coll")`` for collectives.

Every wait is bounded by ``comm.timeout`` (``MINIDIST_TIMEOUT`` seconds, default 300): after
10 s it prints a "still waiting" line naming the operation and the peer; at the timeout it raises
:class:`CommTimeout` naming the waiting rank, its peer and each rank's current operation.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys

import numpy as np

from minidist.accel.backend import backend_of, default_backend
from minidist.comm import tracing
from minidist.comm.ledger import Ledger
from minidist.comm.requests import (  # noqa: F401 - the errors and Request, importable from here as before
    CommError,
    CommTimeout,
    MessageMismatch,
    RankAborted,
    RankExited,
    Request,
    _Converted,
)
from minidist.comm.transports import link
from minidist.comm.waiting import (  # noqa: F401 - the wait every transport's Request.wait runs
    BACKGROUND_LONGEST,
    QUICK_TESTS,
    WaitPolicy,
    _fine_sleeps,
    _thread,
    mark_background_thread,
    poll,
    wait_policy,
)

MAX_USER_TAG = 1 << 20          # user tags are 0 .. MAX_USER_TAG-1; larger ones are minidist's own
OBJ_TAG = MAX_USER_TAG + 1      # pickled-object messages: OBJ_TAG + 2*tag, tag < MAX_OBJ_TAG
MAX_OBJ_TAG = 1 << 18
DEFAULT_TIMEOUT = 300.0         # seconds; MINIDIST_TIMEOUT overrides
NOTICE_AFTER = 10.0             # seconds of waiting before the "still waiting" line


def format_op(op) -> str:
    return op if isinstance(op, str) else f"{op[0]} #{op[1]}"


def default_timeout() -> float:
    return float(os.environ.get("MINIDIST_TIMEOUT", DEFAULT_TIMEOUT))


def debug_enabled() -> bool:
    return os.environ.get("MINIDIST_DEBUG", "0") not in ("", "0", "false", "False")


class Communicator:
    """Abstract base: a group of ``size`` ranks; this object is rank ``rank``'s end of it."""

    transport = "abstract"

    def __init__(self, rank: int, size: int, backend=None, ledger: Ledger | None = None):
        self.rank, self.size = rank, size
        self.backend = backend if backend is not None else default_backend()
        self.ledger = ledger if ledger is not None else Ledger()
        self.twins: dict = {}           # name -> private channel (same group, own messages), see twin()
        self.origin = self              # the communicator this one is a private channel of (itself if none)
        self.strict = False             # every message belongs to a stamped collective call
        self.timeout = default_timeout()
        self.debug = debug_enabled()
        self.seq = 0                    # collectives called on this communicator so far
        self.last_op = "start"          # this rank's current operation (of the origin: see note())
        self.async_worker = None        # the thread that runs this communicator's async collectives
        self.agreed_crowded = None      # cost.agreed_crowded's answer, once the ranks agreed on it
        self.scratch: dict = {}         # dtype -> reusable work buffer of the collectives
        self.expected_wait = None       # why a long wait is expected now (no "still waiting" line): patient()
        self.link = link.current_link()  # an emulated slow link (MINIDIST_LINK) each send pays, or None

    # -- the transport interface (see the module docstring) ------------------------------------
    def isend_buffer(self, buf: np.ndarray, dest: int, tag: int = 0, *, header: bool = False,
                     count: bool = True) -> Request:
        raise NotImplementedError

    def irecv_buffer(self, out: np.ndarray | None, source: int, tag: int = 0, *, header: bool = False,
                     count: bool = True) -> Request:
        raise NotImplementedError

    def split(self, color: int | None, key: int = 0) -> Communicator | None:
        """Like ``MPI_Comm_split``: ranks with equal ``color`` form a group ordered by (key, rank).

        Collective over this communicator. ``color=None`` (or negative) joins no group: returns None.
        """
        raise NotImplementedError

    def make_twin(self, name: str) -> Communicator:
        raise NotImplementedError

    # -- private channels, notes, the watchdog --------------------------------------------------------------
    def twin(self, name: str) -> Communicator:
        """This communicator's private channel ``name`` (same ranks, separate messages): collective the
        first time. ``"coll"`` is strict: collectives talk on it with stamped tags."""
        t = self.twins.get(name)
        if t is None:
            t = self.twins[name] = self.make_twin(name)
            t.origin, t.strict, t.timeout = self.origin, name == "coll", self.timeout
        return t

    @property
    def timeout(self) -> float:
        """Seconds any wait on this communicator (or its private channels) may take: the watchdog."""
        return self._timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._timeout = seconds
        for twin in self.twins.values():
            twin.timeout = seconds

    def note(self, op) -> None:
        """Record this rank's current operation (shown by the watchdog): a string, or a tuple
        (collective name, sequence number) formatted only when shown -- notes must be cheap.
        A private channel notes on its origin, so the watchdog shows the collective, not the
        channel's start."""
        self.origin.last_op = op

    def ranks_status(self) -> str:
        """Each rank's current operation, as far as this rank can know (threads: all; MPI: its own)."""
        return f"rank {self.rank}: {format_op(self.origin.last_op)}"

    def not_arrived(self) -> list[int] | None:
        """Ranks not in this rank's current operation, if this rank can know (threads); else None."""
        return None

    def timeout_error(self, what: str, waited: float) -> CommTimeout:
        return CommTimeout(
            f"watchdog: rank {self.rank} of {self.size} ({self.transport}) waited {waited:.1f} s "
            f"(timeout {self.timeout:g} s, MINIDIST_TIMEOUT) for {what}.\nCurrent operation of each rank:\n  "
            + self.ranks_status().replace("\n", "\n  "))

    def still_waiting(self, what: str, waited: float) -> None:
        """The watchdog's early warning, printed once per wait after ``NOTICE_AFTER`` seconds."""
        late = self.not_arrived()
        sys.stderr.write(
            f"[minidist] rank {self.rank} of {self.size} ({self.transport}): still waiting after "
            f"{waited:.0f} s in {format_op(self.origin.last_op)} for {what}"
            + (f"; ranks not there yet: {late}" if late else "")
            + f"; raises at {self.timeout:g} s (MINIDIST_TIMEOUT)\n")
        sys.stderr.flush()

    def notice_after(self) -> float:
        if self.origin.expected_wait is not None:
            return float("inf")  # the program said this wait is long on purpose; the timeout still holds
        return min(NOTICE_AFTER, self.timeout / 2)

    @contextlib.contextmanager
    def patient(self, why: str):
        """Waits inside are expected to be long (``why``: e.g. "rank 0 trains the model"), so no
        "still waiting" line is printed; the watchdog's timeout still applies."""
        origin = self.origin
        before, origin.expected_wait = origin.expected_wait, why
        try:
            yield self
        finally:
            origin.expected_wait = before

    def check_peer(self, peer: int, what: str) -> int:
        if not isinstance(peer, (int, np.integer)) or not 0 <= peer < self.size:
            raise ValueError(f"rank {self.rank}: {what}={peer!r} is not a rank of this communicator "
                             f"(valid: 0..{self.size - 1})")
        return int(peer)

    def _check_tag(self, tag: int) -> int:
        if not 0 <= tag < MAX_USER_TAG:
            raise ValueError(f"rank {self.rank}: tag={tag} must be in 0..{MAX_USER_TAG - 1}")
        return tag

    # -- arrays -------------------------------------------------------------------------------
    def isend(self, x, dest: int, tag: int = 0) -> Request:
        dest, tag = self.check_peer(dest, "dest"), self._check_tag(tag)
        host = np.ascontiguousarray(backend_of(x).to_host(x))
        self.note(f"send to {dest} tag {tag}")
        return self.isend_buffer(host, dest, tag, header=True)

    def send(self, x, dest: int, tag: int = 0) -> None:
        with tracing.span(f"send->{dest}", "send"):
            self.isend(x, dest, tag).wait()

    def irecv(self, source: int, tag: int = 0, out=None) -> Request:
        source, tag = self.check_peer(source, "source"), self._check_tag(tag)
        self.note(f"recv from {source} tag {tag}")
        if out is not None and isinstance(out, np.ndarray):
            if not out.flags.c_contiguous:
                raise ValueError(f"rank {self.rank}: recv out= must be C-contiguous")
            return self.irecv_buffer(out, source, tag, header=True)
        if out is None:
            return _Converted(self.irecv_buffer(None, source, tag, header=True), self.backend.from_host)
        be = backend_of(out)  # CuPy: staged through host memory, then copied into out; JAX: a new array
        return _Converted(self.irecv_buffer(None, source, tag, header=True),
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

    # -- host buffers: what collectives use -----------------------------------------------------
    def send_buffer(self, buf: np.ndarray, dest: int, tag: int = 0, *, header: bool = False) -> None:
        self.isend_buffer(buf, dest, tag, header=header).wait()

    def recv_buffer(self, buf: np.ndarray | None, source: int, tag: int = 0, *,
                    header: bool = False) -> np.ndarray:
        return self.irecv_buffer(buf, source, tag, header=header).wait()

    def sendrecv_buffer(self, sendbuf: np.ndarray, dest: int, recvbuf: np.ndarray | None, source: int,
                        tag: int = 0, *, header: bool = False) -> np.ndarray:
        """The one exchange: send ``sendbuf`` to ``dest`` while receiving from ``source`` into
        ``recvbuf`` (None with ``header=True``: allocated); returns what arrived. No deadlock."""
        r = self.irecv_buffer(recvbuf, source, tag, header=header)
        self.isend_buffer(sendbuf, dest, tag, header=header).wait()
        return r.wait()

    def barrier(self) -> None:
        """Dissemination barrier: ceil(log2 p) rounds of empty messages."""
        self.note("barrier")
        token, got = np.zeros(0, np.uint8), np.zeros(0, np.uint8)
        k = 1
        while k < self.size:
            r = self.irecv_buffer(got, (self.rank - k) % self.size, OBJ_TAG + 1, count=False)
            self.isend_buffer(token, (self.rank + k) % self.size, OBJ_TAG + 1, count=False).wait()
            r.wait()
            k *= 2

    # -- small Python objects (pickled; counted as header bytes, not payload) -------------------
    def _check_obj_tag(self, tag: int) -> None:
        if not 0 <= tag < MAX_OBJ_TAG:
            raise ValueError(f"rank {self.rank}: object tag={tag} must be in 0..{MAX_OBJ_TAG - 1}")

    def send_obj(self, obj, dest: int, tag: int = 0) -> None:
        dest = self.check_peer(dest, "dest")
        self._check_obj_tag(tag)
        data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        self.ledger.count_header(data.nbytes)
        self.isend_buffer(data, dest, OBJ_TAG + 2 * tag, header=True, count=False).wait()

    def recv_obj(self, source: int, tag: int = 0):
        source = self.check_peer(source, "source")
        self._check_obj_tag(tag)
        data = self.irecv_buffer(None, source, OBJ_TAG + 2 * tag, header=True, count=False).wait()
        return pickle.loads(data.tobytes())

    def bcast_obj(self, obj, root: int = 0):
        root = self.check_peer(root, "root")
        if self.rank == root:
            for r in range(self.size):
                if r != root:
                    self.send_obj(obj, r)
            return obj
        return self.recv_obj(root)

    def gather_obj(self, obj, root: int = 0) -> list | None:
        root = self.check_peer(root, "root")
        if self.rank != root:
            self.send_obj(obj, root)
            return None
        return [obj if r == root else self.recv_obj(r) for r in range(self.size)]

    def allgather_obj(self, obj) -> list:
        return self.bcast_obj(self.gather_obj(obj, 0), 0)

    def close(self) -> None:
        """Stop the async worker of this communicator and of its private channels (if any)."""
        for c in [self, *self.twins.values()]:
            if c.async_worker is not None:
                c.async_worker.stop()
                c.async_worker = None

    def __repr__(self):
        return f"<{type(self).__name__} rank {self.rank} of {self.size}, {self.backend.name}>"
