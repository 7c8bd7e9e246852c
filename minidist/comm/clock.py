"""The virtual clock: each rank keeps the time the cluster it emulates would (SimGrid SMPI's model).

``MINIDIST_CLOCK=virtual`` (a lesson's ``--clock virtual``) gives every rank a ``RankClock``:

* **compute** advances it by the CPU time its thread really used (``time.thread_time``): a rank
  that waits for a free core, or for the GIL, is not charged; time inside the transport is not
  compute and is not charged either;
* **a message** of n bytes leaves when the sender's link is free and arrives ``alpha + n/beta``
  later (``transports/link.Link``: ``MINIDIST_LINK``, default this machine's shared memory);
  the sender's link is busy ``n/beta`` (a blocking send waits that long);
* **a receive** completes at the later of the receiver's clock and the message's arrival;
* each thread acting for a rank has its own lane of the clock (the async worker's collectives run
  beside the compute, as a NIC does); a job starts no earlier than its submission and ``wait()``
  joins its end.

The transports call ``send``, ``pause`` and ``resume``; ``trace.clock.now()`` reads ``now``.
"""

from __future__ import annotations

import os
import threading
import time

from minidist.comm import cost
from minidist.comm.transports.link import Link, current_link
from minidist.trace import clock as trace_clock

_thread_time = time.thread_time


def enabled() -> bool:
    """Does this process run on the virtual clock (``MINIDIST_CLOCK=virtual``)?"""
    mode = os.environ.get("MINIDIST_CLOCK", "wall")
    if mode not in ("wall", "virtual"):
        raise ValueError(f"MINIDIST_CLOCK={mode!r}: use 'wall' (the default) or 'virtual'")
    return mode == "virtual"


def default_link() -> Link:
    """The link messages are charged on: ``MINIDIST_LINK``, else this machine's shared memory as
    the cost model prices it (alpha for a core per rank, 1/beta bytes per second)."""
    return current_link() or Link(cost.LATENCY[False][0], 1 / cost.BETA)


class _Lane:
    __slots__ = ("t", "mark")

    def __init__(self, t: float):
        self.t, self.mark = t, _thread_time()


class RankClock:
    """One rank's virtual time: a lane per thread acting for the rank, one outgoing link."""

    def __init__(self, link: Link | None = None):
        self.link = link or default_link()
        self.link_free = 0.0        # when this rank's outgoing link has pushed its last byte
        self.lanes: dict = {}       # thread id -> _Lane
        self._lock = threading.Lock()

    def adopt_thread(self) -> None:
        """This thread acts for the rank from now on: ``trace.clock.now()`` reads its lane."""
        trace_clock.use(self.now)

    def lane(self) -> _Lane:
        lane = self.lanes.get(threading.get_ident())
        if lane is None:
            lane = self.lanes[threading.get_ident()] = _Lane(0.0)
        return lane

    def now(self) -> float:
        """This thread's virtual seconds, with the compute since the last look charged."""
        lane = self.lane()
        mark = _thread_time()
        lane.t += mark - lane.mark
        lane.mark = mark
        return lane.t

    def pause(self) -> float:
        """Charge the compute so far and stop charging: communication starts (returns the time)."""
        return self.now()

    def resume(self, at: float = 0.0) -> None:
        """Communication ends at virtual time ``at`` (or now): charge compute again from here."""
        lane = self.lane()
        lane.t = max(lane.t, at)
        lane.mark = _thread_time()

    def advance(self, seconds: float) -> None:
        """Work the clock cannot see (an emulated straggler, a device model's op): ``seconds`` more."""
        self.now()
        self.lane().t += seconds

    def send(self, nbytes: int) -> tuple[float, float]:
        """A message leaves now: (when the sender's link is done with it, when it arrives)."""
        t = self.now()
        busy = nbytes / self.link.bandwidth
        with self._lock:
            depart = max(t, self.link_free)
            self.link_free = depart + busy
        return depart + busy, depart + self.link.alpha + busy

    def start_job(self, ready: float) -> None:
        """A background job submitted at ``ready`` starts on this thread's lane."""
        self.resume(ready)
