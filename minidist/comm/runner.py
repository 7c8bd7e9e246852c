"""``run(fn, ranks)``: call ``fn(comm, **kwargs)`` on every rank, on the right transport.

Under ``mpirun``/``mpiexec`` (detected from the launcher's environment, or ``MINIDIST_TRANSPORT=mpi``)
this process is one rank: ``fn`` runs once with an ``MPIComm`` of ``COMM_WORLD``; an exception
prints the traceback with the rank and aborts the whole job (no hang; the aborting rank never
returns from ``run``). When ``fn`` returns, the rank tells every other rank so (a peer still
waiting for it raises ``RankExited`` at once) and waits until all have finished. A rank that
calls ``os._exit`` inside ``fn`` ends the job with exit code 1 and a message naming it (MPICH's
launcher would otherwise end every rank quietly with exit code 0).

Otherwise ``ranks`` threads each run ``fn`` with a ``ThreadComm``; if one raises, the others are
woken with ``RankAborted`` and the first real error is re-raised here, with a note naming its
rank; a rank whose ``fn`` returns is marked finished, so a peer waiting for it raises
``RankExited`` at once instead of waiting for the watchdog. A rank that never returns because it
called ``os._exit`` or ``sys.exit(0)`` (which would end the process with status 0, or silently
drop the rank) makes ``run`` raise ``RankExitedEarly`` naming it; ``sys.exit(N)``, N nonzero, keeps
its status.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback

from minidist.accel.backend import default_backend, set_default_backend
from minidist.comm.requests import RankAborted
from minidist.comm.transports.devices import bind_backend
from minidist.comm.transports.jaxdev import CupyDeviceComm, JaxDeviceComm
from minidist.comm.transports.mpi import MPIComm, finish_handshake, start_board
from minidist.comm.transports.threads import ThreadComm, ThreadWorld

_MPI_ENV = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")


def under_mpi() -> bool:
    """True when this process was started by an MPI launcher (or MINIDIST_TRANSPORT=mpi)."""
    t = os.environ.get("MINIDIST_TRANSPORT", "")
    if t:
        return t == "mpi"
    return any(k in os.environ for k in _MPI_ENV)


def _blas_limit(n_ranks_here: int):
    """One BLAS thread per rank when several ranks share the cores (numpy is already imported)."""
    import contextlib

    if n_ranks_here <= 1 and not under_mpi():
        return contextlib.nullcontext()
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover
        return contextlib.nullcontext()
    return threadpool_limits(1)


_real_exit = os._exit


def _abort(MPI) -> None:
    """Flush, give the launcher a moment to forward our stderr, then end every rank of the job.
    Never returns: MPICH's ``Abort`` may return before the launcher kills this process."""
    for hook in ON_RANK_ERROR:  # a supervisor learns which rank ended the job, and why
        hook(MPI.COMM_WORLD.Get_rank(), sys.exc_info()[1])
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(0.5)
    MPI.COMM_WORLD.Abort(1)
    _real_exit(1)


def _guard_exit(MPI, rank: int, size: int):
    """``os._exit`` while ``fn`` runs: say so and end the whole job with a nonzero exit code."""
    def guarded(code=0):
        sys.stderr.write(f"\n[minidist] rank {rank} of {size} called os._exit({code}) before its function "
                         f"returned from run(); ending the job with exit code 1\n")
        _abort(MPI)
    return guarded


def install_abort_hook() -> None:
    """Under MPI: an uncaught exception anywhere prints its traceback with the rank, then aborts
    every rank of the job (``MPI_Abort``) instead of leaving the others waiting forever."""
    from mpi4py import MPI

    if getattr(sys.excepthook, "_minidist", False):
        return
    previous = sys.excepthook

    def hook(kind, value, tb):
        world = MPI.COMM_WORLD
        sys.stderr.write(f"\n[minidist] rank {world.Get_rank()} of {world.Get_size()}: uncaught exception\n")
        previous(kind, value, tb)
        if world.Get_size() > 1:
            _abort(MPI)

    hook._minidist = True
    sys.excepthook = hook


ON_RANK_START: list = []  # fn(rank) for each MPI rank as it starts (resilience/heartbeat.py: "alive")
ON_RANK_ERROR: list = []  # fn(rank, error) as an MPI rank ends the job (resilience/heartbeat.py: a note)


def _beat_started(rank: int) -> None:
    """Tell whoever registered (a supervisor's heartbeat) that this rank is up, before any step."""
    for hook in ON_RANK_START:
        hook(rank)


def _run_mpi(fn, backend, kwargs):
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_size() == 1 and not any(k in os.environ for k in _MPI_ENV):
        raise RuntimeError("MINIDIST_TRANSPORT=mpi, but no MPI launcher started this process, so it would "
                           "run as a world of 1 rank: start it with `mpirun -n N python ...`, or unset "
                           "MINIDIST_TRANSPORT to run --ranks N threads")
    install_abort_hook()
    if MPI.COMM_WORLD.Get_size() > 1:
        start_board()  # who of the job is blocked in a wait: the watchdog's "still waiting" reads it
    comm = MPIComm(MPI.COMM_WORLD)
    if comm.clock is not None:
        comm.clock.adopt_thread()  # timelines and step times read this rank's virtual clock
    _beat_started(comm.rank)
    comm.backend = bind_backend(backend, comm.rank)
    set_default_backend(comm.backend)
    os._exit = _guard_exit(MPI, comm.rank, comm.size)
    try:
        with _blas_limit(comm.size):
            result = fn(comm, **kwargs)
        comm.close()
        if comm.size > 1:
            finish_handshake(comm)
        return [result]
    except BaseException:
        if comm.size == 1:
            raise
        sys.stderr.write(f"\n[minidist] rank {comm.rank} of {comm.size} raised; aborting the job:\n"
                         + traceback.format_exc())
        _abort(MPI)
    finally:
        os._exit = _real_exit
        comm.close()


class RankExitedEarly(RuntimeError):
    """A rank's function ended the rank (``os._exit``, ``sys.exit(0)``) instead of returning."""


class _ExitCalled(BaseException):
    """Raised in a rank thread in place of ``os._exit``: unwinds that rank only (BaseException, so
    the rank's own ``except Exception`` does not swallow it)."""

    def __init__(self, code):
        super().__init__(code)
        self.code = code


_rank_of_thread = threading.local()  # .rank: set while this thread runs a rank's function
_guard_lock = threading.Lock()
_guard_users = 0
_outside_exit = _real_exit  # what os._exit was before the first threads run() (a grader's guard, say)


def _thread_exit(code=0):
    """``os._exit`` while thread ranks run: inside a rank, unwind that rank; elsewhere, exit."""
    if getattr(_rank_of_thread, "rank", None) is not None:
        raise _ExitCalled(code)
    _outside_exit(code)


def _guard_threads(on: bool) -> None:
    """Install ``_thread_exit`` as ``os._exit`` while any threads run() is in progress."""
    global _guard_users, _outside_exit
    with _guard_lock:
        _guard_users += 1 if on else -1
        if on and _guard_users == 1:
            _outside_exit, os._exit = os._exit, _thread_exit
        elif not on and _guard_users == 0:
            os._exit = _outside_exit


def _early_exit(err: BaseException, r: int, ranks: int) -> BaseException:
    """The error ``run`` raises for rank ``r``'s ``err``: an ``os._exit`` or a successful
    ``sys.exit`` becomes ``RankExitedEarly`` naming the rank; anything else is itself."""
    if isinstance(err, _ExitCalled):
        how = f"os._exit({err.code})"
    elif isinstance(err, SystemExit) and err.code in (None, 0):
        how = f"sys.exit({err.code!r})"
    else:
        return err
    new = RankExitedEarly(f"rank {r} of {ranks} called {how} before its function returned (threads "
                          "transport): the rank never finished, so the run did not succeed")
    new.__cause__ = err if isinstance(err, SystemExit) else None
    return new


def _run_threads(fn, ranks, backend, kwargs, comm_class=ThreadComm):
    world = ThreadWorld(ranks)
    results, errors, order = [None] * ranks, [None] * ranks, []
    lock = threading.Lock()

    def body(r):
        comm, outer = None, getattr(_rank_of_thread, "rank", None)  # outer: a run() inside a rank
        _rank_of_thread.rank = r
        try:
            if outer is None:  # not a run() inside a rank
                _beat_started(r)
            be = bind_backend(backend, r)
            set_default_backend(be)
            if world.clocks is not None:
                world.clocks[r].adopt_thread()  # timelines and step times read the rank's clock
            comm = comm_class(world, (), list(range(ranks)), r, be)  # the graders' rendezvous variant
            results[r] = fn(comm, **kwargs)
            comm.close()
            world.finish(r)  # a peer still waiting for this rank raises RankExited, not a timeout
        except BaseException as e:
            with lock:
                errors[r] = e
                order.append(r)
            world.abort(r)
        finally:
            _rank_of_thread.rank = outer
            if world.clocks is not None:
                world.clocks[r].release_thread()
            if comm is not None:
                comm.close()

    _guard_threads(True)
    try:
        _start_and_join(body, ranks)
    finally:
        _guard_threads(False)
    if order:
        real = [r for r in order if not isinstance(errors[r], RankAborted)] or order
        r = real[0]
        err = _early_exit(errors[r], r, ranks)
        others = sorted(set(order) - {r})
        err.add_note(f"[minidist] raised on rank {r} of {ranks} (threads transport)"
                     + (f"; ranks {others} failed too" if others else ""))
        raise err
    return results


def _start_and_join(body, ranks: int) -> None:
    with _blas_limit(ranks):
        if ranks == 1:
            saved = default_backend()
            try:
                body(0)
            finally:
                set_default_backend(saved)
        else:
            threads = [threading.Thread(target=body, args=(r,), name=f"minidist-rank{r}", daemon=True)
                       for r in range(ranks)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()


def run(fn, ranks: int | None = None, backend=None, transport: str | None = None, **kwargs) -> list:
    """Run ``fn(comm, **kwargs)`` on every rank; return the results in rank order.

    Under MPI this process is a single rank and the list has one element (its own result).
    ``transport="jax"`` (or ``MINIDIST_TRANSPORT=jax``): threads bound to JAX devices whose
    point-to-point arrays move device to device (jaxdev.py); it implies ``backend="jax"``.
    ``transport="cupy"``: the same with CuPy arrays, one GPU per rank.
    """
    chosen = transport or os.environ.get("MINIDIST_TRANSPORT", "")
    if chosen in ("jax", "cupy"):  # device transports (jaxdev.py): threads, arrays device to device
        ranks = 1 if ranks is None else ranks
        cls = JaxDeviceComm if chosen == "jax" else CupyDeviceComm
        return _run_threads(fn, ranks, chosen if backend is None else backend, kwargs, cls)
    if transport not in (None, "threads", "mpi"):
        raise ValueError(f"transport={transport!r}: known transports are 'threads', 'mpi', 'jax', 'cupy'")
    if transport == "mpi" or (transport is None and under_mpi()):
        return _run_mpi(fn, backend, kwargs)
    ranks = 1 if ranks is None else ranks
    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks={ranks!r}: need a positive number of ranks")
    return _run_threads(fn, ranks, backend, kwargs)


def world(ranks: int | None = None):
    """This process's world communicator: MPI's COMM_WORLD under mpirun, else one thread rank.

    (Several thread ranks need ``run``: each must be its own thread.)
    """
    if under_mpi():
        return MPIComm()
    if ranks not in (None, 1):
        raise ValueError(f"world(ranks={ranks}): several thread ranks need minidist.comm.run(fn, ranks)")
    return ThreadComm(ThreadWorld(1), (), [0], 0, default_backend())
