"""The command line every lesson shares: ``--ranks``, ``--backend``, ``--trace``, ``--plot``, ``--seed``.

    parser = lesson_parser("what this lesson shows", ranks=4)
    args = parser.parse_args()
    results = launch(rank_main, args)   # rank_main(comm, args) on every rank

Under ``mpirun`` the ranks are the MPI processes and ``--ranks`` is ignored; otherwise ``--ranks N``
threads. ``--trace FILE.json`` records every rank's spans (``minidist.trace``) and writes one
Chrome trace (open it in https://ui.perfetto.dev).
"""

from __future__ import annotations

import argparse

from minidist.backend import BACKENDS
from minidist.comm import run


def lesson_parser(description: str, ranks: int = 4) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=ranks,
                   help=f"ranks as threads of this process (default {ranks}; ignored under mpirun)")
    p.add_argument("--backend", choices=BACKENDS, default=None,
                   help="array library (default $MINIDIST_BACKEND or numpy)")
    p.add_argument("--trace", metavar="FILE.json", help="write a Chrome trace of every rank")
    p.add_argument("--plot", metavar="FILE.png", help="write a picture")
    p.add_argument("--seed", type=int, default=0)
    return p


def _traced(main_rank_fn):
    """Wrap ``main_rank_fn`` so each rank records a Tracer and rank 0 writes the Chrome trace."""
    def rank_fn(comm, args):
        try:
            from minidist import trace
        except ImportError:
            rprint(comm, "(--trace needs minidist.trace; running without it)")
            return main_rank_fn(comm, args)
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


def launch(main_rank_fn, args) -> list:
    """Run ``main_rank_fn(comm, args)`` on every rank (MPI under mpirun, else ``args.ranks`` threads)."""
    fn = _traced(main_rank_fn) if getattr(args, "trace", None) else main_rank_fn
    return run(fn, ranks=getattr(args, "ranks", None), backend=getattr(args, "backend", None), args=args)


def rprint(comm, *a, **k) -> None:
    """``print`` on rank 0 only (flushed), so N ranks don't print N copies."""
    if comm.rank == 0:
        print(*a, **k, flush=True)
