"""Asynchronous collectives: start now, ``wait()`` later (data parallelism overlaps them with backward).

``all_reduce_async``, ``all_gather_async`` and ``reduce_scatter_async`` queue the blocking
collective on a worker; ``start_async`` queues any function of the communicator.

Each communicator gets one worker thread (per rank) that runs queued collectives in the order they
were started, on a private channel of the communicator (``comm.channel("async")``) so its messages
never mix with the main thread's. Every rank must start the same async collectives in the same
order, exactly like the blocking ones.
"""

from __future__ import annotations

import queue
import threading
import time

from minidist.accel.backend import set_default_backend
from minidist.comm.collectives import all_reduce
from minidist.comm.ring import all_gather, reduce_scatter


class Handle:
    """The future result of an async collective. ``wait()`` returns it (or raises its error)."""

    def __init__(self, comm, name: str):
        self.comm, self.name = comm, name
        self._done = threading.Event()
        self._result = self._error = None
        self.ready = self.done_at = 0.0  # virtual clock: when it was submitted, when it finished

    def test(self) -> bool:
        return self._done.is_set()

    def wait(self):
        start, clock, mark = time.monotonic(), self.comm.clock, getattr(self.comm, "mark_waiting", None)
        if clock is not None:
            clock.pause()
        marked = False
        try:
            while not self._done.wait(0.25):
                if mark is not None and not marked:  # blocked, as in any wait (the watchdog's board)
                    mark(start)
                    marked = True
                if time.monotonic() - start > self.comm.timeout + 1:
                    raise self.comm.timeout_error(f"async {self.name} to finish", time.monotonic() - start)
        finally:
            if marked:
                mark(None)
        if clock is not None:
            clock.resume(self.done_at)  # the job ran beside this thread: its end joins it
        if self._error is not None:
            raise self._error
        return self._result


class AsyncWorker:
    """One background thread running one communicator's async collectives in order.

    It blocks on its queue between jobs and its waits never spin (``comm.mark_background_thread``:
    the transport's wait sleeps at once), so it leaves the GIL and the cores to the compute thread.
    ``busy_seconds`` (wall time inside jobs) and ``cpu_seconds`` (this thread's CPU time) say what
    the communication cost.
    """

    def __init__(self, comm):
        self.comm = comm.channel("async")  # collective: created at the first async call on every rank
        self.jobs: queue.Queue = queue.Queue()
        self.busy_seconds = self.cpu_seconds = 0.0
        self.thread = threading.Thread(target=self._loop, name=f"minidist-async-rank{comm.rank}",
                                       daemon=True)
        self.thread.start()

    def _loop(self):
        set_default_backend(self.comm.backend)
        self.comm.mark_background_thread()
        clock = self.comm.clock
        if clock is not None:
            clock.adopt_thread()  # this thread acts for the rank: its own lane of the rank's clock
        while (job := self.jobs.get()) is not None:
            handle, fn, args, kwargs = job
            t0 = time.perf_counter()
            if clock is not None:
                clock.start_job(handle.ready)
            try:
                handle._result = fn(self.comm, *args, **kwargs)
            except BaseException as e:  # handed to whoever waits
                handle._error = e
            if clock is not None:
                handle.done_at = clock.now()
            self.busy_seconds += time.perf_counter() - t0
            self.cpu_seconds = time.thread_time()
            handle._done.set()

    def submit(self, handle: Handle, fn, args, kwargs) -> Handle:
        self.jobs.put((handle, fn, args, kwargs))
        return handle

    def stop(self):
        self.jobs.put(None)
        self.thread.join(timeout=5)


def start_async(comm, fn, *args, **kwargs) -> Handle:
    """Queue ``fn(channel, *args, **kwargs)`` on ``comm``'s worker; return its Handle."""
    if comm.async_worker is None:
        comm.async_worker = AsyncWorker(comm)
    handle = Handle(comm, fn.__name__)
    if comm.clock is not None:
        handle.ready = comm.clock.now()
    return comm.async_worker.submit(handle, fn, args, kwargs)


def all_reduce_async(comm, x, op: str = "sum", algorithm: str = "auto") -> Handle:
    """Start ``all_reduce`` in the background; ``.wait()`` on the returned Handle gives the result.
    Don't modify x before waiting (NumPy arrays are read by the worker thread)."""
    return start_async(comm, all_reduce, x, op=op, algorithm=algorithm)


def all_gather_async(comm, x, axis: int = 0, sizes=None) -> Handle:
    return start_async(comm, all_gather, x, axis=axis, sizes=sizes)


def reduce_scatter_async(comm, x, op: str = "sum", axis: int = 0) -> Handle:
    return start_async(comm, reduce_scatter, x, op=op, axis=axis)
