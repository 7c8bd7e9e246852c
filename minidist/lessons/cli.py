"""The command line every lesson shares: ``--ranks``, ``--backend``, ``--trace``, ``--plot``, ``--seed``,
and the clock: ``--clock virtual`` (each rank keeps the time the emulated cluster would: compute in
CPU time, or ``--device NAME``'s roofline; each message ``--link``'s alpha + bytes/beta).

    parser = lesson_parser("what this lesson shows", ranks=4)
    parser.add_argument("--steps", type=positive_int, default=3)
    args = parser.parse_args(argv)      # bad values and unwritable --trace/--plot paths: argparse errors
    reject_early(parser, lambda: check_3d(world_size(args), ...))  # a rank's rule, checked in main
    launch(rank_main, args)             # rank_main(comm, args) on every rank; exits 1 on a FAIL

Under ``mpirun`` the ranks are the MPI processes and ``--ranks`` is ignored; otherwise ``--ranks N``
threads. ``--trace FILE.json`` records every rank's spans (``minidist.trace``) and writes one
Chrome trace (open it in https://ui.perfetto.dev).

Exit codes tell the truth: a lesson's ``rank_main`` ends with ``return finish(comm, ok)`` (``ok``:
did every check rank 0 printed say PASS?), and ``launch`` then exits with status 1 when it did not.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import math
import os
import sys
import threading

import numpy as np

from minidist import trace
from minidist.accel.backend import BACKENDS
from minidist.comm import run, under_mpi
from minidist.comm.transports.devices import describe_binding

# -- argument types: a bad value is an argparse error naming the flag and the allowed range -------

def positive_int(text: str) -> int:
    """An integer >= 1 (sizes, counts, steps)."""
    return _int_at_least(text, 1)


def nonnegative_int(text: str) -> int:
    """An integer >= 0 (seeds)."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (learning rates, tolerances)."""
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def probability(text: str) -> float:
    """A finite number in [0, 1) (dropout)."""
    value = _finite(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


class LessonParser(argparse.ArgumentParser):
    """An ArgumentParser that also checks, before any training starts, that the folders of the
    output files (``--trace``, ``--plot`` and any other ``dest`` in ``output_paths``) exist and are
    writable: a typo fails at once, not after the run."""

    output_paths = ("trace", "plot")

    def parse_args(self, args=None, namespace=None):
        ns = super().parse_args(args, namespace)
        for flag, resolve in (("link", link_spec), ("device", device_spec)):
            if getattr(ns, flag, None):
                try:
                    resolve(getattr(ns, flag))
                except ValueError as e:
                    self.error(f"argument --{flag}: {e}")
        for dest in self.output_paths:
            path = getattr(ns, dest, None)
            if path:
                folder = os.path.dirname(os.path.abspath(path))
                flag = "--" + dest.replace("_", "-")
                if os.path.isdir(path):
                    self.error(f"argument {flag}: {path!r} is a folder; give a file name inside it")
                if not os.path.isdir(folder):
                    self.error(f"argument {flag}: folder {folder} of {path!r} does not exist")
                if not os.access(folder, os.W_OK):
                    self.error(f"argument {flag}: folder {folder} of {path!r} is not writable")
        return ns


MAX_THREAD_RANKS = 64  # threads of one process share its cores: more would run for hours, not seconds


def thread_ranks(text: str) -> int:
    """``--ranks``: 1 .. MAX_THREAD_RANKS threads (more ranks: processes, under mpirun)."""
    value = positive_int(text)
    if value > MAX_THREAD_RANKS:
        raise argparse.ArgumentTypeError(
            f"at most {MAX_THREAD_RANKS} ranks run as threads of one process (they share its cores and "
            f"a lesson would not finish in minutes), got {value}; use mpirun -n N for more")
    return value


def lesson_parser(description: str, ranks: int = 4) -> LessonParser:
    p = LessonParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=thread_ranks, default=ranks,
                   help=f"ranks as threads of this process (default {ranks}, at most {MAX_THREAD_RANKS}; "
                        "ignored under mpirun)")
    p.add_argument("--backend", choices=BACKENDS, default=None,
                   help="array library (default $MINIDIST_BACKEND or numpy)")
    p.add_argument("--trace", metavar="FILE.json", help="write a Chrome trace of every rank")
    p.add_argument("--plot", metavar="FILE.png", help="write a picture")
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--clock", choices=("wall", "virtual"), default=None,
                   help="wall: time as this machine runs it; virtual: as the emulated cluster would "
                        "(default $MINIDIST_CLOCK or wall)")
    p.add_argument("--link", metavar="LINK", default=None,
                   help=f"the link every message crosses: {', '.join(LINKS)}, or alpha_us=...,gbps=... "
                        "(virtual clock: charged; wall clock: emulated by waiting)")
    p.add_argument("--device", metavar="NAME", default=None,
                   help="virtual clock: price compute on this device's roofline instead of CPU time "
                        f"({', '.join(DEVICES)}, here, or cpu-time: the default)")
    return p


LINKS = {"nvlink": "alpha_us=5,gBps=450", "ici": "alpha_us=1,gBps=100", "infiniband": "alpha_us=10,gBps=50",
         "ethernet": "alpha_us=30,gBps=1.25"}  # per chip, each way: plan/hardware.py's presets; 10 GbE
DEVICES = ("a100", "h100", "b200", "tpu-v4", "tpu-v5e", "tpu-v5p")


def link_spec(name: str) -> str:
    """A ``--link`` as ``MINIDIST_LINK`` spells it: a named link, "here" (this machine as calibrated,
    ``python -m minidist.calibrate``), or a spec."""
    from minidist.comm.transports.link import parse_link  # defers the link module to a lesson with --link

    if name.lower() in LINKS:
        return LINKS[name.lower()]
    if name.lower() == "here":
        from minidist.plan.hardware import here  # defers the planner to --link here

        link = here().intra
        return f"alpha_us={link.latency * 1e6:g},gBps={link.bandwidth / 1e9:g}"
    parse_link(name)  # a ValueError names what is wrong
    return name


def device_spec(name: str) -> str:
    """A ``--device`` as ``MINIDIST_DEVICE`` spells it, from plan/hardware.py's presets or "here"."""
    from minidist.plan.hardware import get  # defers the planner to --device

    hw = get(name)  # a ValueError lists the presets
    return (f"tflops={hw.peak_flops * hw.gemm_efficiency / 1e12:g},gBps={hw.hbm_bandwidth / 1e9:g},"
            f"overhead_us={hw.op_overhead * 1e6:g},name={hw.name}")


def default_device(args, name: str) -> bool:
    """On the virtual clock a lesson with no ``--device`` (and no ``MINIDIST_DEVICE``) prices compute on
    ``name``'s roofline, not CPU time; returns whether the virtual clock runs."""
    virtual = (args.clock or os.environ.get("MINIDIST_CLOCK") or "wall") == "virtual"
    if virtual and not args.device and not os.environ.get("MINIDIST_DEVICE"):
        args.device = name
    return virtual


def use_clock(args) -> None:
    """Put the lesson's ``--clock``, ``--link`` and ``--device`` into effect for the ranks it starts."""
    from minidist.comm.transports.link import set_link  # defers the link module to launch

    if getattr(args, "clock", None):
        os.environ["MINIDIST_CLOCK"] = args.clock
    if getattr(args, "link", None):
        os.environ["MINIDIST_LINK"] = link_spec(args.link)
        set_link(os.environ["MINIDIST_LINK"])
    if getattr(args, "device", None) and args.device != "cpu-time":
        if os.environ.get("MINIDIST_CLOCK", "wall") != "virtual":
            raise SystemExit("argument --device: a device model prices compute on the virtual clock; "
                             "add --clock virtual")
        os.environ["MINIDIST_DEVICE"] = device_spec(args.device)


def world_size(args) -> int:
    """How many ranks ``launch`` will run: the MPI world under mpirun, else ``--ranks``. Lets a
    lesson check its flags against the world size in ``main``, before any rank starts."""
    if under_mpi():
        from mpi4py import MPI

        return MPI.COMM_WORLD.Get_size()
    return args.ranks


def reject_early(parser, check) -> None:
    """Run ``check()`` -- a rule a rank would enforce (``check_3d``, a schedule builder) -- in ``main``,
    before any rank starts: its ValueError becomes ``parser.error``, exit status 2 and one line, not
    a traceback from every rank. Under mpirun every process checks and exits 2; rank 0 says why."""
    try:
        check()
    except ValueError as e:
        if under_mpi():
            from mpi4py import MPI

            if MPI.COMM_WORLD.Get_rank() != 0:
                raise SystemExit(2) from None
        parser.error(str(e))


def first_accepted(rule, candidates):
    """The first candidate ``rule(candidate)`` accepts (returns without a ValueError), else None: a
    valid alternative to suggest, found by asking the rule itself rather than restating it."""
    for candidate in candidates:
        try:
            rule(candidate)
        except ValueError:
            continue
        return candidate
    return None


def worst(*values) -> float:
    """The largest of ``values`` (numbers or iterables of numbers), NaN if any is NaN: a check's
    ``worst(diffs) <= tol`` then FAILs on a NaN, where ``max()`` would skip it (``max(0.0, nan)`` is 0)."""
    flat = []
    for v in values:
        flat.extend(v if hasattr(v, "__iter__") else [v])
    arr = np.asarray(flat, dtype=np.float64)
    return float(np.max(arr)) if arr.size else 0.0


def available_memory() -> int:
    """Bytes this machine can still give (``MemAvailable``; all of RAM where that is not known)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits(flag: str, value: int, bytes_per_unit: float, what: str) -> None:
    """Refuse (ValueError, for ``reject_early``) a ``flag value`` needing more than the memory left:
    ``value x bytes_per_unit`` bytes, ``what`` says what they hold. The error states the limit."""
    need, have = value * bytes_per_unit, available_memory()
    if need > have:
        raise ValueError(f"argument {flag}: {value:,} needs {need / 2**30:,.2f} GiB ({what}) but this "
                         f"machine has {have / 2**30:,.2f} GiB available; "
                         f"use {flag} <= {int(have // bytes_per_unit):,}")


def _traced(main_rank_fn):
    """Wrap ``main_rank_fn`` so each rank records a Tracer and rank 0 writes the Chrome trace."""
    def rank_fn(comm, args):
        tracer = trace.Tracer(comm.rank)
        trace.set_current(tracer)
        try:
            result = main_rank_fn(comm, args)
        finally:
            trace.set_current(None)
        events = trace.gather_events(comm, tracer)
        if comm.rank == 0:
            trace.write_chrome_trace(args.trace, events)
            print(f"wrote {args.trace}: {len(events)} spans of {comm.size} ranks "
                  "(open in https://ui.perfetto.dev)", flush=True)
        return result
    return rank_fn


def _with_header(rank_fn):
    """Rank 0 first prints where the lesson runs: transport, backend, each rank's device."""
    def with_header(comm, args):
        if comm.rank == 0:
            print(describe_binding(comm.backend, comm.size, comm.transport), flush=True)
            if comm.clock is not None:
                link = comm.clock.link
                print(f"clock: virtual -- each message {link.alpha * 1e6:g} us + bytes / "
                      f"{link.bandwidth / 1e9:g} GB/s; compute "
                      + (f"on {comm.clock.device}" if comm.clock.device else "in CPU time"), flush=True)
        return rank_fn(comm, args)
    return with_header


def launch(main_rank_fn, args) -> list:
    """Run ``main_rank_fn(comm, args)`` on every rank (MPI under mpirun, else ``args.ranks`` threads).

    Returns the ranks' results; exits with status 1 (``SystemExit``) when a rank returned False,
    i.e. ``finish`` saw a failed check."""
    use_clock(args)
    fn = _traced(main_rank_fn) if getattr(args, "trace", None) else main_rank_fn
    results = run(_with_header(fn), ranks=getattr(args, "ranks", None),
                  backend=getattr(args, "backend", None), args=args)
    if any(r is False for r in results):
        raise SystemExit(1)
    return results


def finish(comm, ok: bool) -> bool:
    """The lesson's verdict, called once at the end of ``rank_main``: rank 0's ``ok`` (it printed
    the checks) agreed by every rank, so each MPI process exits with the same status. On a failure
    rank 0 says so on stderr; ``launch`` turns the False into exit status 1."""
    ok = bool(comm.bcast_obj(bool(ok), root=0))
    if not ok and comm.rank == 0:
        print("[minidist] a check printed FAIL (see above): exit status 1", file=sys.stderr, flush=True)
    return ok


def run_lesson(main) -> None:
    """A lesson's ``python -m`` entry: run ``main()``, then end the process with its status (an int
    ``main`` returns, or the code of the ``SystemExit`` it raises; another exception propagates).

    With JAX loaded the process ends without tearing JAX down: freeing every loaded executable and
    the XLA client takes a large part of a short lesson (chapter 16 has the measurement).
    The exit handlers still run and the output is flushed. The ordinary exit is kept where it does
    more than free memory: while a thread that is not a daemon runs (a checkpoint writer, a thread
    pool's worker: the interpreter tells the pool to stop, then waits for them). Under MPI the rank
    finalizes MPI itself first (mpi4py would do it in the interpreter's last hook, and a rank leaving
    without it ends the other ranks' work and hides their failures), then ends through C's ``exit``
    (which frees no Python object) rather than ``_exit``: MPICH's launcher can miss the status of a
    rank that leaves with ``_exit`` after finalizing, and report 0 for a failed job. Tearing JAX down
    is worse than slow there: a multi-controller run's XLA client joins its thread pool while the
    interpreter frees it, and a thread still waiting on the other process (already gone) hangs that
    process after its PASS."""
    try:
        result = main()
        code = result if isinstance(result, int) and not isinstance(result, bool) else 0
    except SystemExit as e:
        code = e.code
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message"): printed, status 1 (as Python does)
        print(code, file=sys.stderr)
        code = 1
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if "jax" not in sys.modules or others:
        sys.exit(code)
    atexit._run_exitfuncs()  # jax.distributed's shutdown among them
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        stream.flush()
    if "mpi4py.MPI" in sys.modules and _finalize_mpi():
        ctypes.CDLL(None).exit(code)  # C's exit: MPICH's launcher then reports this rank's status
    os._exit(code)


def _finalize_mpi() -> bool:
    """MPI_Finalize now (once), as mpi4py's exit hook would: every rank of the job arrives.
    True when this process had MPI running."""
    from mpi4py import MPI  # defers mpi4py: only ranks that already loaded it get here

    if not MPI.Is_initialized() or MPI.Is_finalized():
        return False
    MPI.Finalize()
    return True


def rprint(comm, *a, **k) -> None:
    """``print`` on rank 0 only (flushed), so N ranks don't print N copies."""
    if comm.rank == 0:
        print(*a, **k, flush=True)
