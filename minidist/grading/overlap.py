"""Did a ring hide its transfers behind its multiplies? Read from the order of events, not a timing.

Overlap means: start the transfer (``isend`` / ``irecv``), multiply the chunk in hand, and only
then wait for the transfer. A solution that waits for each transfer before the multiply beside it
(a blocking ``sendrecv``, or ``isend`` + ``wait`` first) computes the same numbers and sends the
same bytes, so neither the result nor the ledger can tell; a stopwatch can't either on a shared
machine. So each rank keeps a log (per thread: ranks are threads here):

* ``EventComm`` (the rendezvous transport with rounds counted) logs every payload transfer's
  start and the moment its ``wait()`` returns;
* ``logged(w)`` is ``w`` viewed as an array that logs every matrix product it takes part in
  (``@``, ``np.matmul``, ``np.dot``, ``np.einsum``, ``np.tensordot``, on any of its views).

``unhidden(events)`` lists the transfers with no multiply between their start and their finish.
"""

from __future__ import annotations

import itertools
import threading

import numpy as np

from minidist.comm.requests import Request
from minidist.grading.rounds import RoundsComm

_log = threading.local()  # .events: this rank's list of (kind, transfer id, what), or absent: not logging
_ids = itertools.count()
PRODUCTS = {np.matmul, np.dot, np.einsum, np.tensordot, np.inner, np.vdot}


def _note(kind: str, ident: int = -1, what: str = "") -> None:
    events = getattr(_log, "events", None)
    if events is not None:
        events.append((kind, ident, what))


def logging(fn):
    """``fn(comm)`` with this rank's event log on: returns (result, events)."""
    def body(comm, *args, **kwargs):
        _log.events = []
        try:
            return fn(comm, *args, **kwargs), list(_log.events)
        finally:
            del _log.events
    return body


class Logged(np.ndarray):
    """An array that logs each matrix product it is an operand of (see the module docstring)."""

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if ufunc is np.matmul:
            _note("multiply")
        plain = [np.asarray(a) if isinstance(a, Logged) else a for a in inputs]
        if "out" in kwargs:
            kwargs["out"] = tuple(np.asarray(o) if isinstance(o, Logged) else o for o in kwargs["out"])
        return getattr(ufunc, method)(*plain, **kwargs)

    def __array_function__(self, func, types, args, kwargs):
        if func in PRODUCTS:
            _note("multiply")
        return super().__array_function__(func, types, args, kwargs)


def logged(a: np.ndarray) -> Logged:
    return np.asarray(a).view(Logged)


class _Transfer(Request):
    """A transport request whose ``wait()`` is logged as the transfer's finish."""

    def __init__(self, req, ident: int):
        self.req, self.ident, self.finished = req, ident, False

    def test(self) -> bool:
        return self.req.test()

    def problem(self):
        return self.req.problem()

    def wait(self):
        out = self.req.wait()
        if not self.finished:
            self.finished = True
            _note("finish", self.ident)
        return out


class EventComm(RoundsComm):
    """The rounds-counting rendezvous transport that logs each payload transfer's start and finish."""

    def isend_buffer(self, buf, dest, tag=0, *, header=False, count=True) -> Request:
        req = super().isend_buffer(buf, dest, tag, header=header, count=count)
        return self._logged(req, f"send to rank {dest}") if count else req

    def irecv_buffer(self, out, source, tag=0, *, header=False, count=True) -> Request:
        req = super().irecv_buffer(out, source, tag, header=header, count=count)
        return self._logged(req, f"receive from rank {source}") if count else req

    def _logged(self, req, what: str) -> _Transfer:
        ident = next(_ids)
        _note("start", ident, what)
        return _Transfer(req, ident)

    def make_channel(self, name: str) -> EventComm:
        return EventComm(self.world, (*self.ctx, "channel", name), self.members, self.rank, self.backend,
                         self.ledger)


def unhidden(events: list) -> list[str]:
    """The transfers (in order) with no multiply between their start and their finish, in words."""
    started: dict = {}
    bad = []
    for i, (kind, ident, what) in enumerate(events):
        if kind == "start":
            started[ident] = (i, what)
        elif kind == "finish" and ident in started:
            begin, what = started.pop(ident)
            if not any(k == "multiply" for k, _, _ in events[begin + 1:i]):
                bad.append(what)
    return bad
