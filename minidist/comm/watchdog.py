"""What every real transport adds around the interface: the watchdog, debug mode and the ledger.

``Watched`` is the base of the threads, MPI and JAX-device transports. It holds no algorithm; it
makes waits safe and observable:

* every wait is bounded by ``comm.timeout`` (``MINIDIST_TIMEOUT`` seconds, default 300): a "still
  waiting" line names the operation and the peer -- after ``NOTICE_AFTER`` seconds when no rank of
  the job is working (each is blocked in a wait: a hang), after ``BUSY_NOTICE`` of the timeout while
  one is (``board``: rank 0 computing a serial twin is work in flight, not a hang) -- and at the
  timeout :class:`CommTimeout` names the waiting rank, its peer and each rank's current operation;
  ``with comm.patient(why):`` silences the line for a wait that is long on purpose;
* ``wait_all`` and ``wait_any`` test several requests together and raise a failed or mismatched
  peer's error;
* debug mode (``MINIDIST_DEBUG=1``): collectives compare every rank's call first (debug.py);
* a fresh ``Ledger`` (ledger.py) and the process's emulated link (transports/link.py);
* ``all_reduce_algorithm``: what ``all_reduce(algorithm="auto")`` runs, by the cost model (cost.py).
"""

from __future__ import annotations

import contextlib
import os
import sys

from minidist.comm import cost, debug, waiting
from minidist.comm.communicator import Communicator, format_op
from minidist.comm.ledger import Ledger
from minidist.comm.requests import CommTimeout, default_timeout
from minidist.comm.transports import link
from minidist.comm.waiting import poll

NOTICE_AFTER = 10.0             # seconds of waiting before the "still waiting" line (no rank working)
BUSY_NOTICE = 0.75              # ... while another rank works: this share of the timeout


def first_problem(requests):
    """Why a pending request of ``requests`` can never complete (a failed, departed or mismatched
    peer's error), or None."""
    return next((e for q in requests if not q.test() and (e := q.problem()) is not None), None)


def debug_enabled() -> bool:
    return os.environ.get("MINIDIST_DEBUG", "0") not in ("", "0", "false", "False")


class Watched(Communicator):
    """A Communicator whose waits the watchdog bounds and explains (see the module docstring)."""

    def __init__(self, rank: int, size: int, backend=None, ledger: Ledger | None = None):
        super().__init__(rank, size, backend, ledger if ledger is not None else Ledger())
        self.timeout = default_timeout()
        self.debug = debug_enabled()
        self.expected_wait = None       # why a long wait is expected now (no "still waiting" line)
        self.agreed_crowded = None      # cost.agreed_crowded's answer, once the ranks agreed on it
        self.link = link.current_link()
        self.board, self.board_rank = None, rank  # who of the job is blocked in a wait (see mark_waiting)

    @property
    def timeout(self) -> float:
        """Seconds any wait on this communicator (or its private channels) may take."""
        return self._timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._timeout = seconds
        for ch in self.channels.values():
            ch.timeout = seconds

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

    def mark_waiting(self, since: float | None) -> None:
        """This rank's foreground thread is blocked in a wait since ``since`` (None: it works again).
        The transport keeps a ``board`` of the job's ranks (threads: a list; MPI on one node: shared
        memory), 0 for a working rank, -1 for one that returned; background threads don't count."""
        if self.board is not None and not waiting.in_background():
            self.board[self.board_rank] = 0.0 if since is None else since

    def working_ranks(self) -> list[int] | None:
        """The job's other ranks that are working (not blocked in a wait, not returned), or None where
        this rank can't know (MPI across nodes)."""
        board, me = self.board, self.board_rank
        return None if board is None else [r for r in range(len(board)) if board[r] == 0 and r != me]

    def still_waiting(self, what: str, waited: float) -> float:
        """Called once a wait passed ``notice_after()`` seconds: the watchdog's early warning, unless
        another rank of the job is working -- a long wait for work in flight (rank 0 computing a
        serial twin) is no hang -- until ``BUSY_NOTICE`` of the timeout. Returns the waited seconds
        at which to call again (inf once the line is printed)."""
        busy = self.working_ranks()
        if busy and waited < BUSY_NOTICE * self.timeout:
            return min(waited + 0.5, BUSY_NOTICE * self.timeout)
        late = self.not_arrived()
        sys.stderr.write(
            f"[minidist] rank {self.rank} of {self.size} ({self.transport}): still waiting after "
            f"{waited:.0f} s in {format_op(self.origin.last_op)} for {what}"
            + ("" if busy is None else f"; ranks working: {busy}" if busy else "; every rank is waiting")
            + (f"; ranks not there yet: {late}" if late else "")
            + f"; raises at {self.timeout:g} s (MINIDIST_TIMEOUT)\n")
        sys.stderr.flush()
        return float("inf")

    def notice_after(self) -> float:
        if getattr(self.origin, "expected_wait", None) is not None:
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

    def wait_any(self, requests: list, what: str) -> None:
        """Wait until one of ``requests`` can complete (each tested every time); a pending request's
        ``problem()`` is raised as in ``wait_all``."""
        poll(lambda: any([q.test() for q in requests]), self, what, lambda: first_problem(requests))

    def wait_all(self, requests: list, what: str) -> None:
        """Wait for every request together (testing all of them each time, so all make progress);
        while waiting, a request's ``problem()`` (a failed, departed or mismatched peer) is raised."""
        poll(lambda: all([q.test() for q in requests]), self, what, lambda: first_problem(requests))
        for q in requests:
            q.wait()

    def check_same_call(self, signature: dict) -> None:
        """Debug mode: raise on every rank unless every rank passes an equal ``signature``."""
        debug.check_same_call(self, signature)

    def mark_background_thread(self) -> None:
        waiting.mark_background_thread()

    def all_reduce_algorithm(self, x, op: str) -> str:
        """The algorithm ``all_reduce(algorithm="auto")`` runs for x: the cost model's choice."""
        return cost.choose_for(self, x, op)
