"""The ledger: what every rank really sent, so each textbook formula can be measured.

Every transport calls :meth:`Ledger.count_send` / :meth:`Ledger.count_recv` for each payload
message (array bytes only; the small shape/dtype headers are counted apart, in ``header_bytes``).
Every collective call opens a :class:`CallRecord` (name, bytes, steps) through ``open_call``
(call.py's ``collective``); its algorithm counts rounds with ``k.step()``.

Read it with ``with measure(comm) as m: ...`` then ``m.bytes_sent``, ``m.steps``, ``m.calls``.

A sub-communicator's ledger has its parent's ledger as ``parent``: traffic on a tensor-parallel
group shows up in that group's ledger *and* in the world's.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

from minidist.comm import call


@dataclass
class CallRecord:
    """One collective call on one rank: what it moved and in how many rounds."""

    name: str
    bytes_sent: int = 0
    bytes_received: int = 0
    messages: int = 0
    steps: int = 0

    @property
    def bytes(self) -> int:
        return self.bytes_sent

    def step(self, n: int = 1) -> None:
        self.steps += n


class Ledger:
    """Per-rank, per-communicator counters. Thread safe (async collectives count from a worker)."""

    FIELDS = ("bytes_sent", "bytes_received", "messages", "messages_received", "steps",
              "header_bytes")

    def __init__(self, parent: Ledger | None = None):
        self.parent = parent
        self.bytes_sent = self.bytes_received = self.messages = self.messages_received = 0
        self.steps = self.header_bytes = 0
        self.calls: list[CallRecord] = []  # kept only while a ``measure`` block watches
        self.watching = 0
        self._lock = threading.Lock()

    def _chain(self):
        led = self
        while led is not None:
            yield led
            led = led.parent

    def count_send(self, nbytes: int) -> None:
        for led in self._chain():
            with led._lock:
                led.bytes_sent += nbytes
                led.messages += 1
        rec = current_call()
        if rec is not None:
            rec.bytes_sent += nbytes
            rec.messages += 1

    def count_recv(self, nbytes: int) -> None:
        for led in self._chain():
            with led._lock:
                led.bytes_received += nbytes
                led.messages_received += 1
        rec = current_call()
        if rec is not None:
            rec.bytes_received += nbytes

    def count_sendrecv(self, sent: int, received: int) -> None:
        """One message each way (the step of a ring or butterfly): count_send + count_recv."""
        led = self
        while led is not None:
            with led._lock:
                led.bytes_sent += sent
                led.messages += 1
                led.bytes_received += received
                led.messages_received += 1
            led = led.parent
        rec = current_call()
        if rec is not None:
            rec.bytes_sent += sent
            rec.messages += 1
            rec.bytes_received += received

    def count_call(self, name: str, sent: int, received: int, steps: int) -> None:
        """A whole collective call that no ``collective`` record counted (shm.py's lean path): its
        bytes, one message each way and its steps, in one pass; its CallRecord where watched."""
        led, rec = self, None
        while led is not None:
            with led._lock:
                led.bytes_sent += sent
                led.bytes_received += received
                led.messages += 1
                led.messages_received += 1
                led.steps += steps
                if led.watching:
                    rec = rec or CallRecord(name, sent, received, 1, steps)
                    led.calls.append(rec)
            led = led.parent

    def count_header(self, nbytes: int) -> None:
        for led in self._chain():
            with led._lock:
                led.header_bytes += nbytes

    def open_call(self, name: str) -> CallRecord:
        """The record of a collective call starting on this rank (call.py's ``collective``)."""
        return CallRecord(name)

    def finish_call(self, rec: CallRecord) -> None:
        led = self  # (a loop, not _chain(): this runs on every collective call)
        while led is not None:
            with led._lock:
                led.steps += rec.steps
                if led.watching:  # a long run must not keep a record of every call it ever made
                    led.calls.append(rec)
            led = led.parent

    def snapshot(self) -> dict:
        with self._lock:
            return {f: getattr(self, f) for f in self.FIELDS} | {"ncalls": len(self.calls)}

    def __repr__(self):
        return (f"<Ledger sent={self.bytes_sent}B recv={self.bytes_received}B msgs={self.messages} "
                f"steps={self.steps} calls={len(self.calls)}>")


def current_call() -> CallRecord | None:
    """The record of the collective call open on this thread (rank), if a ledger counts it."""
    k = call.current()
    return None if k is None else k.rec


class Measurement:
    """Differences of a ledger between entering and leaving a ``measure`` block."""

    def __init__(self, ledger: Ledger):
        self._ledger = ledger
        with ledger._lock:
            ledger.watching += 1
        self._start = ledger.snapshot()
        self._end = self._calls = None

    def _get(self, f):
        now = self._end if self._end is not None else self._ledger.snapshot()
        return now[f] - self._start[f]

    bytes_sent = property(lambda self: self._get("bytes_sent"))
    bytes_received = property(lambda self: self._get("bytes_received"))
    messages = property(lambda self: self._get("messages"))
    steps = property(lambda self: self._get("steps"))
    header_bytes = property(lambda self: self._get("header_bytes"))

    @property
    def calls(self) -> list[CallRecord]:
        if self._calls is not None:
            return self._calls
        return self._ledger.calls[self._start["ncalls"]:]

    def freeze(self):
        led = self._ledger
        self._end = led.snapshot()
        self._calls = led.calls[self._start["ncalls"]:self._end["ncalls"]]
        with led._lock:
            led.watching -= 1
            if led.watching == 0:
                led.calls.clear()

    def __repr__(self):
        return (f"<Measurement sent={self.bytes_sent}B received={self.bytes_received}B "
                f"messages={self.messages} steps={self.steps} calls={[c.name for c in self.calls]}>")


@contextlib.contextmanager
def measure(comm):
    """``with measure(comm) as m:`` -- bytes, messages, steps and calls of this rank inside the block."""
    m = Measurement(comm.ledger)
    try:
        yield m
    finally:
        m.freeze()
