"""How a rank waits for a message: ``poll`` and the ``WaitPolicy`` it follows.

A transport's ``Request.wait`` calls ``poll(test, comm, what, check)``: spin with ``sched_yield``
(which releases the GIL and the core), then sleep with exponential backoff, checking for a failed
or mismatched peer while it sleeps, printing a "still waiting" line after ``comm.notice_after()``
seconds and raising ``comm.timeout_error`` at ``comm.timeout``. How long it spins and how long it
sleeps is decided once per process (``wait_policy``: a crowded host spins less); a thread marked
with ``mark_background_thread`` (the async worker) sleeps at once.
"""

from __future__ import annotations

import os
import threading
import time

from minidist.comm import cost
from minidist.comm.call import current as current_call

CHECK_GRACE = 0.2               # seconds a peer problem seen while waiting must persist (see poll)


class WaitPolicy:
    """How a wait spends its time, in two phases (decided once per process, see ``wait_policy``):

    1. ``spin`` (``collective_spin`` inside a collective): test, then ``sched_yield``, so any other
       runnable rank gets the core -- spinning only uses time nobody else wants, and MPI moves a
       large message only while we poll. A collective's ranks are all active and answer soon, so
       inside one we spin longer.
    2. sleep with exponential backoff up to ``longest``: a rank waiting for a pipeline stage or a
       slow peer leaves the CPU to whoever computes (at the price of a wake-up per message).

    Before both, ``quick`` tests in a row (no yield): a small message on its way lands within
    microseconds. Not on a crowded host, where the peer that must send it may need this very core.
    """

    def __init__(self, spin: float, collective_spin: float, longest: float, quick: int = 0):
        self.spin, self.collective_spin, self.longest, self.quick = spin, collective_spin, longest, quick

    def __repr__(self):
        return (f"WaitPolicy(quick={self.quick} tests, " + ", ".join(
            f"{k}={getattr(self, k) * 1e6:g} us" for k in ("spin", "collective_spin", "longest")) + ")")


_POLICY: list = []  # [WaitPolicy], decided once per process


def wait_policy() -> WaitPolicy:
    """The process's WaitPolicy. More ranks on this host than cores ("crowded"): spin 1 ms (5 ms in
    a collective), then sleep up to 1 ms. Otherwise spin 5 ms (20 ms), sleep up to 0.2 ms.
    ``MINIDIST_SPIN_US`` and ``MINIDIST_COLL_SPIN_US`` set the spin times."""
    if not _POLICY:
        crowded = cost.crowded()  # looked up on the module: tests replace cost.crowded

        def us(name, default):
            return float(os.environ.get(name, default)) * 1e-6

        _POLICY.append(WaitPolicy(spin=us("MINIDIST_SPIN_US", 1000 if crowded else 5000),
                                  collective_spin=us("MINIDIST_COLL_SPIN_US", 5000 if crowded else 20000),
                                  longest=1e-3 if crowded else 2e-4, quick=0 if crowded else QUICK_TESTS))
    return _POLICY[0]


_thread = threading.local()


def mark_background_thread() -> None:
    """This thread only communicates (``handles.AsyncWorker``): its waits never spin. A spinning
    background thread takes the GIL back after every ``sched_yield`` and keeps a core busy, both of
    which the compute thread (backward) needs; sleeping with backoff (20 us doubling to
    ``BACKGROUND_LONGEST``) costs at most that much latency per wait and almost no CPU."""
    _thread.background = True


def in_background() -> bool:
    """Is this thread marked as a background (communication-only) thread?"""
    return getattr(_thread, "background", False)


BACKGROUND_LONGEST = 2e-4       # seconds: the longest sleep of a background thread's wait
QUICK_TESTS = 32                # tests in a row before a foreground wait starts to yield


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


def poll(test, comm, what, check=None) -> None:
    """Wait until ``test()`` is true: spin with ``sched_yield``, then sleep with exponential backoff
    (see ``WaitPolicy``; a collective spins longer). While sleeping, every 5 ms ``check()`` may
    return an error (a mismatched or departed peer): raised once it has persisted ``CHECK_GRACE``
    seconds with ``test()`` still false (a large message may still be arriving while the peer's next
    one is already seen). After ``comm.notice_after()`` seconds the "still waiting" line is printed,
    after ``comm.timeout`` the watchdog's :class:`CommTimeout` is raised. ``what``: a string, or a
    callable giving one (built only if shown)."""
    progress = getattr(comm, "progress", None)  # MPI: post payload receives whose header arrived
    if progress is not None:
        progress()
    if test():
        return
    policy = wait_policy()
    if not getattr(_thread, "background", False):
        for _ in range(policy.quick):  # a small message on its way lands within microseconds: don't
            if test():               # give the core away (sched_yield) before it had the chance
                return
    if not getattr(_thread, "fine", False):
        _fine_sleeps()
    clock = time.monotonic
    start = clock()
    longest = policy.longest
    if getattr(_thread, "background", False):  # a communication thread: sleep at once (see above)
        spin_until, longest = start, BACKGROUND_LONGEST
    else:
        spin_until = start + (policy.collective_spin if current_call() is not None else policy.spin)
    notice_at, next_check, problem_since = start + comm.notice_after(), start, None
    delay, yield_ = 2e-5, os.sched_yield
    board = getattr(comm, "board", None)  # past the spin, this rank is marked as blocked (watchdog.py)
    marked = False
    try:
        while not test():
            if progress is not None:
                progress()
            now = clock()
            if now < spin_until:
                yield_()
                continue
            if board is not None and not marked:
                comm.mark_waiting(start)
                marked = True
            if check is not None and now >= next_check:
                error = check()
                if error is None:
                    problem_since = None
                elif problem_since is None:
                    problem_since = now
                elif now - problem_since > CHECK_GRACE and not test():
                    raise error
                next_check = now + 5e-3
            if now > notice_at:
                notice_at = start + comm.still_waiting(what() if callable(what) else what, now - start)
            if now - start > comm.timeout:
                raise comm.timeout_error(what() if callable(what) else what, now - start)
            time.sleep(delay)
            delay = min(delay * 2, longest)
    finally:
        if marked:
            comm.mark_waiting(None)
