"""The MPI transport's pending operations: a raw send or receive, and a receive with a header.

A receive with a header first receives the header, then posts its payload ``Irecv``; payloads are
posted strictly in the order the receives were posted per (source, tag) (``_drain``), so several
pending receives from one peer still match the right messages. Every wait is ``poll``'s ``Test`` +
sleep with backoff, asking the communicator about its peer while it sleeps. Re-exported by
``minidist.comm.transports.mpi``.
"""

from __future__ import annotations

import collections

import numpy as np

from minidist.comm.requests import MessageMismatch, Request
from minidist.comm.transports.mpi_wire import (
    HEADER_LEN,
    _bytes,
    _check_count,
    _mpi,
    _truncated,
    decode_header,
)
from minidist.comm.waiting import poll


class _MPIRequest(Request):
    """A raw send, or a raw receive (``out`` given: its size is checked when it completes).

    Virtual clock: ``at`` is when a send's link is done with it; a receive's stamp (its arrival)
    comes in ``stamp``, an MPI message of its own on the header's tag (``reqs[1]``)."""

    def __init__(self, comm, reqs, keep, what, peer, tag, out=None, at=0.0, stamp=None):
        self.comm, self.reqs, self.keep, self.what = comm, reqs, keep, what
        self.peer, self.tag, self.out, self.at, self.stamp = peer, tag, out, at, stamp
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
            if self.stamp is not None:
                self.reqs[1].Wait()  # sent before the payload: here already
        return self.done

    def problem(self):
        return self.comm.peer_problem(self.peer, self.tag, self.out is not None)

    def wait(self):
        clock = self.comm.clock
        if clock is None:
            poll(self.test, self.comm, self.what, self.problem)
            return self.out
        clock.pause()
        poll(self.test, self.comm, self.what, self.problem)
        clock.resume(self.at if self.stamp is None else float(self.stamp[0]))
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

    def __init__(self, comm, source, tag, out, count):
        self.comm, self.source, self.tag, self.out, self.count = comm, source, tag, out, count
        self.h = np.empty(HEADER_LEN + (comm.clock is not None), np.int64)  # + the arrival: a virtual clock
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
        clock = self.comm.clock
        if clock is not None:
            clock.pause()
        poll(self.test, self.comm, f"a message from rank {self.source} (tag {self.tag})", self.problem)
        if clock is not None:
            clock.resume(float(self.h[HEADER_LEN:].view(np.float64)[0]))
        if self.count:
            self.comm.ledger.count_recv(self.out.nbytes)
            self.count = False
        return self.out
