"""Lesson 10: fault tolerance -- a rank dies mid-training, the job restarts and loses (almost) nothing.

    python -m minidist.launch -n 4 -- python -m minidist.lessons.fault_tolerance
    python -m minidist.launch -n 4 --threads -- python -m minidist.lessons.fault_tolerance

Under the supervisor (``python -m minidist.launch``) the first attempt kills its last rank in the
middle of training (``--fault``, any ``minidist.resilience.faults`` spec). Every ``--mem-every``
steps each rank's shard goes to shared memory (tier 1), every ``--disk-every`` steps to disk (tier
2), both written by a background thread. The supervisor restarts the job from the newest intact
tier; rank 0 prints the failure, the tier recovered from, the steps lost, and checks the final
parameters against a run that never failed (bit for bit; after an elastic restart, the serial twin
within a tolerance). The job's id is the supervisor's (``MINIDIST_JOB_ID``) or ``--job``: its folders
are claimed for it before training, and ``--job ID`` resumes an earlier job. ``--plot`` draws every
attempt's timeline, ``--trace`` merges every attempt's spans (each rank appends its part after every
step: a killed attempt never reaches the end). Chapter 10 walks through it.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import tempfile
import time

import numpy as np

from minidist import trace
from minidist.accel.backend import default_backend
from minidist.comm.transports.threads import ThreadComm, ThreadWorld
from minidist.lessons.cli import (
    finish,
    first_accepted,
    launch,
    lesson_parser,
    nonnegative_int,
    positive_int,
    probability,
    reject_early,
    rprint,
    world_size,
)
from minidist.lessons.fault_tolerance_job import MeshTrainer, small_config
from minidist.lessons.progress import progress
from minidist.nn.serial import adamw_tolerance
from minidist.parallel.parallelize import check_3d
from minidist.resilience.checkpoint import CheckpointError, folder
from minidist.resilience.checkpoint.tiers import Checkpointer, Tier, shm_root, sweep_shm
from minidist.resilience.faults import Injector
from minidist.resilience.faults import parse as parse_faults
from minidist.resilience.heartbeat import heartbeat
from minidist.resilience.timeline import AttemptTrace, merge_attempts, plot_attempts

LR = 3e-3  # AdamW's learning rate of every trainer here (the failing run, its reference, the serial twin)


def default_ckpt(job: str) -> str:
    """The disk tier of a job given no --ckpt: its own folder, removed when the job succeeds."""
    return os.path.join(tempfile.gettempdir(), f"minidist-{os.getuid()}-fault-tolerance-{job}")


def _log(comm, **event):
    """Rank 0 appends an event to the supervisor's log (the timeline), if there is one."""
    path = os.environ.get("MINIDIST_SUPERVISOR_LOG")
    if path and comm.rank == 0:
        with open(path, "a") as f:
            f.write(json.dumps({"t": time.time(), **event}) + "\n")


def _events():
    path = os.environ.get("MINIDIST_SUPERVISOR_LOG")
    if not path or not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path) if line.strip()]


def young_daly(cost_s: float, mtbf_s: float) -> float:
    """The checkpoint interval that minimises expected lost time: sqrt(2 x cost x MTBF)."""
    return math.sqrt(2 * cost_s * mtbf_s)


def train(comm, args, fault: str, job: str, disk: str):
    """Train job ``job`` to ``args.steps`` with tiered checkpoints (``disk``: the disk tier's folder)
    and injected faults. Returns (trainer, checkpointer, restore info, tier restored from)."""
    attempt = int(os.environ.get("MINIDIST_RESTART", "0"))
    mem = args.mem_dir or shm_root(hashlib.sha1(os.path.abspath(disk).encode()).hexdigest()[:10])
    err = None
    if comm.rank == 0:  # the job's folders are its own (a new job's are new or empty), or it stops here
        try:
            sweep_shm(job)  # the shared memory that killed jobs left
            for d, every in ((disk, 1), (mem, args.mem_every), (mem + "-peer", args.peer_every)):
                if every:  # (the disk folder always: it is the job's, and says so from the start)
                    folder.claim(d, job, hold=True)
        except CheckpointError as e:
            err = f"--ckpt / --mem-dir: {e}"
            folder.note(err, "refused")  # a restart would meet the same folder: the supervisor stops
        if attempt == 0 and args.attempt_trace:  # a new run: the trace parts of an earlier one go
            AttemptTrace.clear(args.attempt_trace)
    err = comm.bcast_obj(err, root=0)
    if err:
        raise SystemExit(f"rank {comm.rank}: {err}")
    cfg = small_config(args.dtype, args.dropout)
    trainer = MeshTrainer(comm, cfg, pp=args.pp, tp=args.tp, zero=args.zero, lr=LR, total_steps=args.steps,
                          job=job)
    inj = Injector.from_env(comm.rank, fault)
    tiers = [Tier("memory", mem, args.mem_every), Tier("peer", mem + "-peer", args.peer_every, peer=True),
             Tier("disk", disk, args.disk_every, keep=3)]
    ckpt = Checkpointer(comm, tiers,
                        asynchronous=not args.sync, fault=inj)
    info, tier = ckpt.restore(trainer.state())
    _log(comm, event="restore", attempt=attempt, step=info.step, tier=tier, seconds=info.seconds,
         problems=info.problems)
    if attempt:
        where = (f"its tier {tier} checkpoint of step {info.step}" if info.step is not None
                 else "scratch (no checkpoint was committed)")
        rprint(comm, f"attempt {attempt} resumed from {where}: its first step is step "
                     f"{trainer.step_count + 1}")
    tracing = AttemptTrace(args.attempt_trace, comm.rank, attempt) if args.attempt_trace else None
    heartbeat(comm.rank, trainer.step_count)
    bar = progress(total=args.steps, initial=trainer.step_count, desc=f"attempt {attempt}", rank=comm.rank)
    while trainer.step_count < args.steps:
        _announce_kill(comm, inj, trainer.step_count)
        inj.on_step(trainer.step_count)
        t0 = time.time()
        with trace.span(f"step {trainer.step_count + 1}", "step", step=trainer.step_count + 1):
            trainer.step()
        heartbeat(comm.rank, trainer.step_count)
        _log(comm, event="step", attempt=attempt, step=trainer.step_count, t0=t0, t1=time.time())
        if ckpt.maybe_save(trainer.step_count, trainer.state()):
            _log(comm, event="save", attempt=attempt, step=trainer.step_count, stall=ckpt.stalls[-1])
        if tracing is not None:  # flushed every step: a rank killed later keeps what it did so far
            tracing.flush()
        bar.update(1)
    bar.close()
    ckpt.wait()
    if tracing is not None:
        tracing.stop()
    return trainer, ckpt, info, tier


def _announce_kill(comm, inj, step: int) -> None:
    """The rank a kill fault is about to end says so first: MPICH's banner that follows is expected."""
    for f in inj.faults:
        if f.kind in ("kill", "lose") and f.step == step:
            print(f"rank {comm.rank}: injecting {f} now. Under mpirun, the 'BAD TERMINATION' banner MPICH "
                  "prints next is this injected kill, and expected: the supervisor restarts the job.",
                  flush=True)


def rank_main(comm, args):
    supervised = "MINIDIST_HEARTBEAT_DIR" in os.environ
    job = comm.bcast_obj(args.job or os.environ.get("MINIDIST_JOB_ID") or folder.new_job_id(), root=0)
    disk = args.ckpt or default_ckpt(job)
    fault = args.fault
    if fault is None:
        fault = os.environ.get("MINIDIST_FAULT") or (
            f"kill:rank={comm.size - 1},step={args.steps // 2 + 1}" if supervised else "")
    fault = "" if fault == "none" else fault
    rprint(comm, f"fault tolerance: {comm.size} ranks, {args.steps} steps, tier 1 (memory) every "
                 f"{args.mem_every}, tier 2 (disk) every {args.disk_every}, "
                 f"{'synchronous' if args.sync else 'asynchronous'} saves; fault: {fault or 'none'}; "
                 f"job {job}, checkpoints in {disk}")
    if not supervised:
        rprint(comm, "  (no supervisor: run `python -m minidist.launch -n 4 -- python -m "
                     "minidist.lessons.fault_tolerance` to see a rank die and the job recover)")
    trainer, ckpt, info, tier = train(comm, args, fault, job, disk)
    full = trainer.full_parameters()
    comm.barrier()
    if comm.rank == 0:  # the job is done: give tier 1's shared memory back (the disk tier stays if named)
        for t in [t for t in ckpt.tiers[:2] if t.every] + (ckpt.tiers[2:] if args.ckpt is None else []):
            folder.remove(t.root, job)

    # the reference: the same job, started fresh here, never interrupted, never checkpointed
    events = _events()
    first = next((e for e in events if e.get("event") == "start"), None)
    same_mesh = first is None or first["ranks"] == comm.size
    ref_trainer = MeshTrainer(comm, small_config(args.dtype, args.dropout), pp=args.pp, tp=args.tp,
                              zero=args.zero, lr=LR, total_steps=args.steps) if same_mesh else None
    if ref_trainer is not None:
        while ref_trainer.step_count < args.steps:
            ref_trainer.step()
        ref = ref_trainer.full_parameters()
    ok = True
    if comm.rank == 0:
        if ref_trainer is None:  # elastic: compare with the serial twin
            ref = _serial_twin(args)
        failures = [e for e in events if e.get("event") == "failure"]
        restores = {e["attempt"]: e for e in events if e.get("event") == "restore"}
        for e in failures:
            nxt = restores.get(e["attempt"] + 1, {})
            known = e.get("last_step") is not None and nxt
            lost = e["last_step"] - (nxt.get("step") or 0) if known else None
            print(f"failure: attempt {e['attempt']}, rank {e['rank']}: {e['status']} "
                  f"at step {e['last_step']}")
            if nxt and nxt.get("step") is None:
                print(f"  restarted from scratch (no checkpoint was committed yet); steps lost: {lost}")
            elif nxt:
                print(f"  recovered from tier {nxt.get('tier')} checkpoint of step {nxt.get('step')} in "
                      f"{1e3 * nxt['seconds']:.1f} ms; steps lost (recomputed): {lost}")
                for p in nxt.get("problems", []):
                    print(f"  skipped: {p}")
        if info.step is not None and not failures:
            print(f"restored from tier {tier}, step {info.step}, in {1e3 * info.seconds:.1f} ms")
        diff = max(float(np.max(np.abs(np.asarray(full[k], np.float64) - np.asarray(ref[k], np.float64))))
                   for k in ref)
        if same_mesh:
            ok = all(np.array_equal(full[k], ref[k]) for k in ref) and full.keys() == ref.keys()
            print(f"final parameters vs a run that never failed: max abs diff {diff:.3g} -> "
                  f"{'PASS (bit-identical)' if ok else 'FAIL'}")
        else:
            tol = 1e-9 if args.dtype == "float64" else adamw_tolerance(LR, args.steps)  # summation order
            ok = diff <= tol
            print(f"elastic restart ({first['ranks']} -> {comm.size} ranks): final parameters vs the "
                  f"serial twin: "
                  f"max abs diff {diff:.3g} (tolerance {tol:g}) -> {'PASS' if ok else 'FAIL'}")
        _report_costs(ckpt)
        never = [t.name for t in ckpt.tiers if any(e.startswith(f"{t.name} step ") for e in ckpt.errors)
                 and not any(name == t.name for name, _, _ in ckpt.written)]
        for name in never:  # a tier whose every save failed protects nothing: the run did not do its job
            first = next(e for e in ckpt.errors if e.startswith(f"{name} step "))
            print(f"FAIL: every {name} checkpoint of this attempt failed (the first: {first})")
        ok = ok and not never
        if args.out:
            np.savez(args.out, **full)
        if args.plot:
            plot_attempts(args.plot, _events())
            print(f"wrote {args.plot}")
        if args.attempt_trace:
            events = merge_attempts(args.attempt_trace)
            print(f"wrote {args.attempt_trace}: {len(events)} spans of attempts "
                  f"{sorted({e['attempt'] for e in events})} (one process per attempt; open it in "
                  "https://ui.perfetto.dev)")
    return finish(comm, ok)


def _serial_twin(args):
    """The same training on one process (a one-rank threads communicator, even inside an MPI job)."""
    one = ThreadComm(ThreadWorld(1), (), [0], 0, default_backend())
    t = MeshTrainer(one, small_config(args.dtype, args.dropout), dp=1, lr=LR, total_steps=args.steps)
    while t.step_count < args.steps:
        t.step()
    return t.full_parameters()


def _report_costs(ckpt):
    """Stall per save, write time per tier, and the Young/Daly interval they imply."""
    if not ckpt.stalls:
        return
    writes = {}
    for name, _, s in ckpt.written:
        writes.setdefault(name, []).append(s)
    stall = 1e3 * float(np.median(ckpt.stalls))
    parts = ", ".join(f"{n} write {1e3 * float(np.median(v)):.2f} ms" for n, v in writes.items())
    print(f"checkpoint cost (median, rank 0): training stall {stall:.2f} ms; {parts}")
    mtbf = 5 * 3600.0  # e.g. 10,000 chips with a 50,000-hour MTBF each: one failure every 5 hours
    if "disk" in writes:
        sync_cost, async_cost = float(np.median(writes["disk"])), float(np.median(ckpt.stalls))
        print(f"Young/Daly, job MTBF 5 h: checkpoint every sqrt(2 C MTBF) = "
              f"{young_daly(sync_cost, mtbf):.1f} s with C = the disk write ({1e3 * sync_cost:.2f} ms, a "
              f"synchronous save), {young_daly(async_cost, mtbf):.1f} s with C = the stall of an "
              f"asynchronous one ({1e3 * async_cost:.2f} ms)")


def main(argv=None):
    p = lesson_parser("A rank dies; the supervisor restarts the job from its checkpoints.", ranks=4)
    p.add_argument("--steps", type=positive_int, default=12)
    p.add_argument("--mem-every", type=nonnegative_int, default=2,
                   help="tier 1 (shared memory) every N steps (0: off)")
    p.add_argument("--peer-every", type=nonnegative_int, default=0,
                   help="tier 1 copy kept by the ring neighbour every N steps (0: off)")
    p.add_argument("--disk-every", type=nonnegative_int, default=4,
                   help="tier 2 (disk) every M steps (0: off)")
    p.add_argument("--sync", action="store_true", help="synchronous saves (default: background writer)")
    p.add_argument("--fault", default=None, help="a MINIDIST_FAULT spec, or 'none'")
    p.add_argument("--ckpt", help="the disk checkpoint folder: new, empty, or this job's (default: one for "
                   "the job in the temporary folder, removed when the job succeeds)")
    p.add_argument("--job", help="the job's id: an earlier job's to resume it (default: the supervisor's, "
                   "else a new one)")
    p.add_argument("--mem-dir", help="tier 1's directory (default: one in /dev/shm for this --ckpt)")
    p.add_argument("--pp", type=positive_int, default=1)
    p.add_argument("--tp", type=positive_int, default=1)
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0)
    p.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    p.add_argument("--dropout", type=probability, default=0.1)
    p.add_argument("--out", help="write the final parameters here (.npz)")
    p.output_paths = (*p.output_paths, "out")  # --out's folder must exist and be writable
    args = p.parse_args(argv)
    check_flags(p, args, world_size(args))
    check_folder(p, args)
    args.attempt_trace, args.trace = args.trace, None  # traced here, per attempt (see the docstring)
    launch(rank_main, args)


def check_flags(parser, args, world: int) -> None:
    """The mesh, batch split and --fault spec every rank would check, checked once before any rank
    starts (exit status 2, one line): the Trainer's own rules, with its batch and microbatch counts."""
    defaults = inspect.signature(MeshTrainer).parameters
    batch, micro = defaults["batch_size"].default, defaults["microbatches"].default
    cfg = small_config(args.dtype, args.dropout)
    mesh = args.pp * args.tp
    if args.zero and mesh > 1:  # MeshTrainer: ZeRO is data parallel only here
        parser.error(f"argument --zero: ZeRO-{args.zero} is data parallel only here (got --pp {args.pp} "
                     f"--tp {args.tp}); use --pp 1 --tp 1 with --zero, or --zero 0")

    def mesh_rule(ranks):  # parallelize's check_3d with the trainer's batch, for a job of `ranks` ranks
        check_3d(ranks, cfg, batch, max(1, ranks // mesh), args.pp, args.tp, micro)

    try:
        mesh_rule(world)
    except ValueError as e:
        alt = first_accepted(mesh_rule, range(world, 0, -1))
        fix = f"; --ranks {alt} works with --pp {args.pp} --tp {args.tp}" if alt else ""
        parser.error(f"argument --ranks/--pp/--tp: {str(e).removeprefix('rank 0: ')}{fix}")
    if args.fault not in (None, "none"):
        reject_early(parser, lambda: _check_fault(args.fault, world))


def check_folder(parser, args) -> None:
    """--job and --ckpt, checked before any rank starts with the rule the saves apply (folder.py):
    a folder another job owns, one with files minidist did not write, a link, one others can write."""
    job = args.job or os.environ.get("MINIDIST_JOB_ID")
    try:
        if job is not None:
            folder.check_job_id(job)
    except ValueError as e:
        parser.error(f"argument --job: {e}")
    ckpt = args.ckpt if args.ckpt is not None else default_ckpt(job) if job else None
    try:
        if ckpt is not None:
            folder.check(ckpt, job or folder.NEW_JOB)
    except CheckpointError as e:
        folder.note(f"--ckpt: {e}", "refused")  # under a supervisor: not restarted into the same refusal
        parser.error(f"argument --ckpt: {e}")


def _check_fault(spec: str, world: int) -> None:
    try:
        faults = parse_faults(spec)
    except ValueError as e:
        raise ValueError(f"argument --fault: {e}; e.g. --fault kill:rank={world - 1},step=3 or "
                         "--fault none") from None
    attempt = int(os.environ.get("MINIDIST_RESTART", "0"))  # an elastic restart runs on fewer ranks
    for f in faults:
        if f.attempt == attempt and f.rank >= world:
            raise ValueError(f"argument --fault: {f} names rank {f.rank}, but the job has ranks "
                             f"0..{world - 1}")


if __name__ == "__main__":
    from minidist.lessons.cli import run_lesson

    run_lesson(main)
