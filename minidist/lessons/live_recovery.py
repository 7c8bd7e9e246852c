"""Live recovery: a replica group is killed mid-run and training goes on (chapter 10, section 6).

    mpirun -n 4 python -m minidist.lessons.live_recovery          # 4 agents, each the parent of a worker
    python -m minidist.lessons.live_recovery --ranks 4            # 4 threads of one process
    python -m minidist.lessons.live_recovery --ranks 4 --tp 2     # 2 groups of 2 (tensor parallel inside)

Each rank is one member of a replica group (``--tp``/``--pp``: the mesh inside a group). A coordinator
decides each step which groups take part and says so when the set changes. ``--fault`` kills a group
(default: the member of group 1 when step 4 begins): the others finish that step without it, the
effective batch shrinks, a replacement heals from a live peer -- parameters, AdamW's m and v, the RNG
and the data position, over the transport -- and rejoins at a step boundary. At the end: each step's
quorum, the heal, every slot's processes (the survivors' PIDs never change: ``restarts: 0``), and the
final parameters against the serial twin given the same quorum sequence (PASS: bit-identical).
``--plot FILE.png`` draws each group's steps (took part, healed, absent) and the step times; ``--trace
FILE.json`` the same as a Chrome trace, one track per group.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import tempfile

import numpy as np

from minidist.comm import under_mpi
from minidist.lessons.cli import (
    launch,
    lesson_parser,
    positive_float,
    positive_int,
    reject_early,
    run_lesson,
    world_size,
)
from minidist.lessons.live_recovery_job import LiveGPTJob, live_config, quorum_twin
from minidist.resilience.attempts import newest_good_checkpoint
from minidist.resilience.checkpoint.tiers import Checkpointer, Tier
from minidist.resilience.live import launch as live_launch
from minidist.resilience.live.faults import parse as parse_faults

TP_TOL = 1e-10  # tensor parallelism inside a group sums row-parallel partial products in another order


def parser():
    p = lesson_parser(__doc__.split("\n\n")[0], ranks=4)
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel ranks inside a group")
    p.add_argument("--pp", type=positive_int, default=1, help="pipeline stages inside a group")
    p.add_argument("--steps", type=positive_int, default=10)
    p.add_argument("--rows", type=positive_int, default=2, help="batch rows per group per step")
    p.add_argument("--fault", default="kill:group=1,step=4",
                   help="faults (minidist.resilience.live.faults): kill, hang, unreachable; '' for none")
    p.add_argument("--hang-timeout", type=positive_float, default=3.0,
                   help="seconds a member may stay silent before it counts as hung")
    p.add_argument("--ckpt", help="checkpoint folder, for a whole-job failure (default: a temporary one)")
    p.add_argument("--ckpt-every", type=positive_int, default=5)
    return p


def _layout(args, ranks: int) -> tuple[int, int]:
    k = args.tp * args.pp
    if args.tp > 1 and args.pp > 1:
        raise ValueError("use --tp or --pp inside a group, not both")
    if ranks % k or ranks // k < 2:
        raise ValueError(f"{ranks} ranks do not make 2 or more replica groups of tp x pp = {k}; use a "
                         f"multiple of {k} that is at least {2 * k}")
    parse_faults(args.fault)
    return ranks // k, k


def _job(args, groups, g, pos):
    cfg = live_config(dropout=0.1 if args.tp * args.pp == 1 else 0.0)
    return LiveGPTJob(cfg, g, pos, groups, args.rows, pp=args.pp, tp=args.tp, seed=args.seed)


def _newest(args):
    return lambda: newest_good_checkpoint(args.ckpt)[0]


def _checkpointer(folder, every):
    return lambda comm: Checkpointer(comm, [Tier("disk", folder, every=every, keep=2)], asynchronous=False)


def _worker(args) -> int:
    groups, _ = _layout(args, int(os.environ["MINIDIST_LIVE_RANKS"]))
    args.ckpt = os.environ["MINIDIST_LIVE_CKPT"]
    return live_launch.serve_worker(functools.partial(_job, args, groups), args.steps, args.fault,
                                    checkpointer=_checkpointer(args.ckpt, args.ckpt_every),
                                    resume=int(os.environ.get("MINIDIST_RESTART", "0")) > 0)


def _agents(comm, args):
    groups, k = _layout(args, comm.size)
    os.environ["MINIDIST_LIVE_RANKS"] = str(comm.size)  # the workers inherit these (not MPI variables)
    os.environ["MINIDIST_LIVE_CKPT"] = args.ckpt
    argv = [sys.executable, "-m", "minidist.lessons.live_recovery", *sys.argv[1:]]
    if comm.rank == 0:
        _intro(args, comm.size, groups, k, f"mpi: {comm.size} agents, each the parent of one worker process")
    run = live_launch.run_agents(comm, argv, groups, k, args.steps, hang_timeout=args.hang_timeout,
                                 rows=args.rows, newest_checkpoint=_newest(args))
    return _report(args, run, groups, k, processes=True) if comm.rank == 0 else True


def _intro(args, ranks, groups, k, how) -> None:
    inside = "none" if k == 1 else (f"tp={args.tp}" if args.tp > 1 else f"pp={args.pp}")
    print(f"live recovery: {ranks} ranks ({how}); {groups} replica groups of {k} (inside a group: {inside}); "
          f"{args.steps} steps, AdamW, {args.rows} rows per group; fault: {args.fault or 'none'}; "
          f"checkpoints every {args.ckpt_every} steps (for a whole-job failure)", flush=True)


def _report(args, run, groups, k, processes: bool) -> bool:
    if run.error is not None:
        print(f"FAIL: {run.error}")
        if args.temporary_ckpt:
            print("(the lesson kept its checkpoints in a temporary folder, now removed: give --ckpt DIR to "
                  "keep them, and run it under python -m minidist.launch --ckpt DIR to restart from them)")
        return False
    print(f"\n{'step':>4}  {'quorum':<14}{'healing':<18}{'attempts':>8}  effective batch")
    for r in run.history:
        heal = ", ".join(f"{h} <- group {d}" for h, d in sorted(r.healing.items())) or "-"
        print(f"{r.step:>4}  {str(list(r.participants)):<14}{heal:<18}{r.attempts:>8}  "
              f"{len(r.participants) * args.rows} of {groups * args.rows} rows")
    for step, g, member, donor, dg, nbytes, secs in run.heals:
        print(f"heal: group {g} (member {member}) took {nbytes / 1e3:.1f} kB -- parameters, AdamW m and v, "
              f"then the RNG streams and the data position -- from member {donor} (group {dg}) during step "
              f"{step} in {secs * 1e3:.1f} ms, and rejoined the quorum at step {step + 1}")
    ended = {}
    for slot, lives in sorted(run.lives.items()):
        shown = " -> ".join(f"{'pid ' if processes else ''}{who} ({how})" for _, who, how in lives)
        ended[slot] = len(lives)
        print(f"  slot {slot} (group {slot // k}, position {slot % k}): {shown}")
    kept = [s for s, n in ended.items() if n == 1]
    print(f"survivors kept their {'PIDs' if processes else 'threads'} (slots {kept}); the job was never "
          f"restarted: restarts: 0")
    if args.plot:
        _plot(args.plot, run, groups)
    if args.trace:
        _trace(args.trace, run, groups)
    return _check(args, run, groups, k)


def _plot(path, run, groups) -> None:
    """Groups as rows, steps as columns: took part (blue), healed (orange), absent (grey); the kills
    (x); below, each step's wall time (the retried one is longer)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4))
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    for r in run.history:
        for g in range(groups):
            color = "#4c72b0" if g in r.participants else "#dd8452" if g in r.healing else "#cccccc"
            top.broken_barh([(r.step - 0.45, 0.9)], (g - 0.4, 0.8), facecolors=color)
        for g, _ in r.lost:
            top.plot([r.step], [g], "rx", markersize=12)
    top.set_yticks(range(groups))
    top.set_ylabel("replica group")
    top.invert_yaxis()
    top.set_title("took part (blue), healing from a live peer (orange), absent (grey), failed (x)",
                  loc="right", fontsize=9)
    bottom.bar([r.step for r in run.history], [(r.t1 - r.t0) * 1e3 for r in run.history], color="#4c72b0")
    bottom.set_ylabel("step (ms)")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def _trace(path, run, groups) -> None:
    """A Chrome trace of the coordinator's view: a track per group, a span per step it took part in or
    healed during, an instant where it was lost."""
    t = min((r.t0 for r in run.history), default=0.0)
    out = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": g, "args": {"name": f"group {g}"}}
           for g in range(groups)]
    for r in run.history:
        for g in list(r.participants) + list(r.healing):
            out.append({"name": f"step {r.step}" + (" (healing)" if g in r.healing else ""), "ph": "X",
                        "pid": 0, "tid": g, "ts": (r.t0 - t) * 1e6, "dur": (r.t1 - r.t0) * 1e6,
                        "args": {"quorum": list(r.participants), "attempts": r.attempts}})
    for when, kind, g, what in run.events:
        out.append({"name": f"{kind}: {what}", "ph": "i", "s": "t", "pid": 0, "tid": g,
                    "ts": (when - t) * 1e6})
    with open(path, "w") as f:
        json.dump({"traceEvents": out, "displayTimeUnit": "ms"}, f)
    print(f"wrote {path}: {len(out)} events of {groups} groups (open in https://ui.perfetto.dev)")


def _check(args, run, groups, k) -> bool:
    finals = list(run.finals.values())
    same = True
    for pos in range(k):
        mine = [f for f in finals if f["pos"] == pos]
        for other in mine[1:]:
            a, b = mine[0], other
            same &= a["arrays"].keys() == b["arrays"].keys() and all(
                np.array_equal(a["arrays"][n], b["arrays"][n]) for n in a["arrays"])
            same &= all(a["small"][key] == b["small"][key] for key in ("optimizer", "objects"))
            same &= a["small"]["rngs"]["job"] == b["small"]["rngs"]["job"]
    print(f"every group's state at the end (parameters, AdamW m and v, step, data position, RNG) equal, "
          f"healed and survivors: {'yes (bit-identical)' if same else 'NO'}")
    cfg = live_config(dropout=0.1 if k == 1 else 0.0)
    quorums = finals[0]["small"]["objects"]["trainer"]["quorums"]  # all of them, a restarted job's too
    want = quorum_twin(cfg, quorums, groups, args.rows, seed=args.seed)
    diff = max(float(np.max(np.abs(f["full"][n] - want[n]))) for f in finals if f["full"] is not None
               for n in want)
    tol = TP_TOL if args.tp > 1 else 0.0
    ok = same and diff <= tol
    exact = "bit-identical" if diff == 0 else f"within {tol:g}: tp sums partial products in another order"
    print(f"final parameters vs the serial twin given this quorum sequence: max abs diff {diff:.3g} -> "
          f"{'PASS' if ok else 'FAIL'}" + (f" ({exact})" if ok else ""))
    return ok


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if "MINIDIST_LIVE" in os.environ:  # a worker process started by an agent
        return _worker(args)
    reject_early(p, lambda: _layout(args, world_size(args)))
    temp = args.temporary_ckpt = args.ckpt is None
    resume = int(os.environ.get("MINIDIST_RESTART", "0")) > 0  # a supervisor's restart: from the checkpoint
    if temp and (not under_mpi() or os.environ.get("PMI_RANK", "0") == "0"):
        args.ckpt = tempfile.mkdtemp(prefix="minidist-live-")
    try:
        if under_mpi():
            if temp:  # every agent must name the same folder: rank 0's
                args.ckpt = _shared_folder(args.ckpt)
            results = launch(_agents, args)
            return 0 if all(r is not False for r in results) else 1
        groups, k = _layout(args, args.ranks)
        _intro(args, args.ranks, groups, k, "threads of one process")
        run = live_launch.run_threads(functools.partial(_job, args, groups), groups, k, args.steps,
                                      faults=args.fault, hang_timeout=args.hang_timeout, rows=args.rows,
                                      checkpointer=_checkpointer(args.ckpt, args.ckpt_every),
                                      newest_checkpoint=_newest(args), resume=resume)
        return 0 if _report(args, run, groups, k, processes=False) else 1
    finally:
        if temp and args.ckpt:
            shutil.rmtree(args.ckpt, ignore_errors=True)


def _shared_folder(mine):
    from mpi4py import MPI

    return MPI.COMM_WORLD.bcast(mine, root=0)


if __name__ == "__main__":
    run_lesson(main)
