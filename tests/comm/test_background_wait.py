"""The async worker's waits leave the CPU (and the GIL) to the compute thread.

A wait in a thread marked as background (``mark_background_thread``, which every ``AsyncWorker``
does) sleeps with backoff from the start instead of spinning with ``sched_yield``; the worker
counts its busy and CPU seconds, which the DDP benchmark reports per step. A foreground wait tests
a few times in a row before it yields the core (small messages land within microseconds).
"""

from __future__ import annotations

import threading
import time

from minidist.comm import run, waiting
from minidist.comm.handles import start_async
from minidist.comm.waiting import mark_background_thread, poll

WAITS, WAIT_S = 20, 0.005


class _Peerless:
    """Just enough of a communicator for ``poll``: no progress engine, no peer to check."""

    timeout = 30.0

    def notice_after(self):
        return float("inf")


def _background_wait_counts(monkeypatch):
    """(tests, sched_yields) of a background thread that waits WAITS times for WAIT_S each."""
    yields, tests = [], []
    monkeypatch.setattr(waiting.os, "sched_yield", lambda: yields.append(1))

    def waiter():
        mark_background_thread()
        for _ in range(WAITS):
            deadline = time.perf_counter() + WAIT_S
            poll(lambda d=deadline: tests.append(1) or time.perf_counter() >= d, _Peerless(), "a deadline")

    t = threading.Thread(target=waiter)
    t.start()
    t.join()
    return len(tests), len(yields)


def test_a_background_wait_does_not_spin(monkeypatch):
    # Counted, not timed (a CPU share flaked on a loaded 2-core machine, 1 run in 6): a background wait
    # never yields (no spin phase) and sleeps with backoff. Each sleep lasts at least its length, on any
    # load: 20 + 40 + 80 + 160 us, then 200 us (BACKGROUND_LONGEST) -- 4 + ceil(4700 / 200) = 28 sleeps
    # cover a 5 ms wait, so it tests at most 1 + 28 + 1 times. Spinning tests thousands of times.
    assert waiting.BACKGROUND_LONGEST == 2e-4 and WAIT_S == 0.005  # the numbers worked out above
    tests, yields = _background_wait_counts(monkeypatch)
    assert yields == 0
    assert WAITS <= tests <= WAITS * 30, tests


def test_the_spin_policy_is_left_to_foreground_threads():
    policy = waiting.wait_policy()
    assert policy.spin >= 1e-3  # the foreground keeps its spin (latency) phase
    assert waiting.BACKGROUND_LONGEST <= 1e-3  # a background wait oversleeps at most this much


def test_async_worker_marks_itself_background_and_counts_its_time():
    def job(c):
        time.sleep(0.05)
        return getattr(waiting._thread, "background", False), threading.current_thread().name

    def rank(comm):
        h = start_async(comm, job)
        marked, name = h.wait()
        worker = comm.async_worker
        return marked, name, worker.busy_seconds, worker.cpu_seconds

    marked, name, busy, cpu = run(rank, ranks=1)[0]
    assert marked and name.startswith("minidist-async")
    assert busy >= 0.05  # the job's sleep is busy (wall) time...
    assert cpu < busy  # ...but not CPU time


def test_a_foreground_wait_tests_a_few_times_before_yielding_the_core(monkeypatch):
    yields = []
    monkeypatch.setattr(waiting.os, "sched_yield", lambda: yields.append(1))
    calls = []

    def arrives_on_third_test():
        calls.append(1)
        return len(calls) >= 3

    poll(arrives_on_third_test, _Peerless(), "a message already on its way")
    assert len(calls) == 3 and not yields  # caught by testing again, no sched_yield (a lost time slice)

    calls.clear()
    poll(lambda: calls.append(1) or len(calls) > waiting.QUICK_TESTS + 5, _Peerless(), "a slow one")
    assert yields  # a longer wait does yield: the spin phase leaves the core to runnable ranks


def test_a_crowded_host_yields_at_once_instead_of_testing_in_a_row(monkeypatch):
    # more ranks than cores: the peer that must send may need this very core, so no quick tests
    monkeypatch.setattr(waiting, "_POLICY", [waiting.WaitPolicy(1e-3, 5e-3, 1e-3, quick=0)])
    yields = []
    monkeypatch.setattr(waiting.os, "sched_yield", lambda: yields.append(1))
    calls = []
    poll(lambda: calls.append(1) or len(calls) >= 3, _Peerless(), "a message already on its way")
    assert len(calls) == 3 and len(yields) == 1  # tested, yielded, tested: the third test found it
