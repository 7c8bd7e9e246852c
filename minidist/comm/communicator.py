"""The Communicator: one rank's view of a group of ranks, the interface every algorithm uses.

An algorithm is SPMD code for one rank with its communicator passed in (``ring_all_reduce(comm,
x)``). A transport subclasses ``Communicator`` in one file and writes four methods:

* ``isend_buffer(buf, dest, tag=0, *, header=False, count=True) -> Request`` -- start sending the
  contiguous NumPy buffer ``buf``; ``header=True``: its shape and dtype travel with it.
* ``irecv_buffer(out, source, tag=0, *, header=False, count=True) -> Request`` -- start receiving
  into ``out`` (``None`` with ``header=True``: allocated); ``wait()`` returns the array.
* ``split(color, key=0)`` -- like ``MPI_Comm_split``: new communicators for groups of ranks.
* ``make_channel(name)`` -- a communicator over the same ranks whose messages never match ours.

On these this class builds the rest: arrays of any backend (``send``, ``recv``, ``isend``,
``irecv``, ``sendrecv``), host buffers (what collectives use), small pickled objects, a barrier and
private channels. Machinery attaches to a communicator, never to the algorithms: the transport
counts bytes in ``comm.ledger`` (``count=False``: headers and objects), waits under the watchdog
(watchdog.py) and pays an emulated link; ``trace.spans`` records sends and receives.
"""

from __future__ import annotations

import pickle
import time

import numpy as np

from minidist.accel.backend import backend_of, default_backend
from minidist.comm.requests import CommError, CommTimeout, MessageMismatch, RankAborted, RankExited, Request
from minidist.comm.requests import Converted as _Converted
from minidist.trace.spans import span

__all__ = ["CommError", "CommTimeout", "Communicator", "MessageMismatch", "RankAborted", "RankExited",
           "Request", "format_op"]

MAX_USER_TAG = 1 << 20          # user tags are 0 .. MAX_USER_TAG-1; larger ones are minidist's own
OBJ_TAG = MAX_USER_TAG + 1      # pickled-object messages: OBJ_TAG + 2*tag, tag < MAX_OBJ_TAG
MAX_OBJ_TAG = 1 << 18


def format_op(op) -> str:
    return op if isinstance(op, str) else f"{op[0]} #{op[1]}"


class Communicator:
    """Abstract base: a group of ``size`` ranks; this object is rank ``rank``'s end of it."""

    transport = "abstract"
    debug = False                   # debug mode: collectives compare every rank's call first (debug.py)
    timeout = float("inf")          # seconds a wait may take (a transport's watchdog sets it)
    clock = None                    # the rank's virtual clock (clock.py), when one runs

    def __init__(self, rank: int, size: int, backend=None, ledger=None):
        self.rank, self.size = rank, size
        self.backend = backend if backend is not None else default_backend()
        self.ledger = ledger            # what this rank sent (ledger.py), counted by the transport
        self.channels: dict = {}        # name -> private channel (same group, own messages)
        self.origin = self              # the communicator this one is a private channel of
        self.strict = False             # every message belongs to a stamped collective call (call.py)
        self.seq = 0                    # collectives called on this communicator so far
        self.last_op = "start"          # this rank's current operation, for the watchdog (see note)
        self.async_worker = None        # the thread that runs this communicator's async collectives
        self.scratch: dict = {}         # dtype -> reusable work buffer of the collectives
        self.link = None                # an emulated slow link each send pays (transports/link.py)

    # -- the transport interface (see the module docstring) ------------------------------------
    def isend_buffer(self, buf: np.ndarray, dest: int, tag: int = 0, *, header: bool = False,
                     count: bool = True) -> Request:
        raise NotImplementedError

    def irecv_buffer(self, out: np.ndarray | None, source: int, tag: int = 0, *, header: bool = False,
                     count: bool = True) -> Request:
        raise NotImplementedError

    def split(self, color: int | None, key: int = 0) -> Communicator | None:
        """Ranks with equal ``color`` form a group ordered by (key, rank); collective over this
        communicator. ``color=None`` (or negative) joins no group: returns None."""
        raise NotImplementedError

    def make_channel(self, name: str) -> Communicator:
        raise NotImplementedError

    # -- private channels and notes ------------------------------------------------------------
    def channel(self, name: str) -> Communicator:
        """This communicator's private channel ``name`` (same ranks, separate messages): collective
        the first time. ``"coll"`` is strict: collectives talk on it with stamped tags."""
        ch = self.channels.get(name)
        if ch is None:
            ch = self.channels[name] = self.make_channel(name)
            ch.origin, ch.strict, ch.timeout = self.origin, name == "coll", self.timeout
        return ch

    def note(self, op) -> None:
        """Record this rank's current operation (what the watchdog shows): a string, or a tuple
        (collective, call number) formatted only when shown. A channel notes on its origin."""
        self.origin.last_op = op

    def wait_all(self, requests: list, what: str) -> None:
        """Wait for every request (a transport's watchdog tests them together, see watchdog.py)."""
        for q in requests:
            q.wait()

    def all_reduce_algorithm(self, x, op: str) -> str:
        """What ``all_reduce(algorithm="auto")`` runs here (a transport asks its cost model)."""
        return "ring"

    def mark_background_thread(self) -> None:
        """This thread only communicates (an async worker): a transport's waits may sleep at once."""

    def wait_any(self, requests: list, what: str) -> None:
        """Wait until one of ``requests`` can complete (a transport's watchdog bounds the wait)."""
        while not any([q.test() for q in requests]):
            time.sleep(1e-4)

    def check_peer(self, peer: int, what: str) -> int:
        if not isinstance(peer, (int, np.integer)) or not 0 <= peer < self.size:
            raise ValueError(f"rank {self.rank}: {what}={peer!r} is not a rank of this communicator "
                             f"(valid: 0..{self.size - 1})")
        return int(peer)

    def _check_tag(self, tag: int) -> int:
        if not 0 <= tag < MAX_USER_TAG:
            raise ValueError(f"rank {self.rank}: tag={tag} must be in 0..{MAX_USER_TAG - 1}")
        return tag

    # -- arrays of any backend: the receiver learns shape and dtype from a small header ----------
    def isend(self, x, dest: int, tag: int = 0) -> Request:
        dest, tag = self.check_peer(dest, "dest"), self._check_tag(tag)
        host = np.ascontiguousarray(backend_of(x).to_host(x))
        self.note(f"send to {dest} tag {tag}")
        return self.isend_buffer(host, dest, tag, header=True)

    def send(self, x, dest: int, tag: int = 0) -> None:
        with span(f"send->{dest}", "send"):
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
        with span(f"recv<-{source}", "recv"):
            return self.irecv(source, tag, out).wait()

    def sendrecv(self, x, dest: int, source: int, sendtag: int = 0, recvtag: int = 0, out=None):
        r = self.irecv(source, recvtag, out)
        s = self.isend(x, dest, sendtag)
        with span(f"sendrecv->{dest}<-{source}", "wait"):
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
        """Send ``sendbuf`` to ``dest`` while receiving from ``source`` into ``recvbuf`` (None with
        ``header=True``: allocated); returns what arrived. Never deadlocks."""
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
        if self.ledger is not None:
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
        for c in [self, *self.channels.values()]:
            if c.async_worker is not None:
                c.async_worker.stop()
                c.async_worker = None

    def __repr__(self):
        return f"<{type(self).__name__} rank {self.rank} of {self.size}, {self.backend.name}>"
