"""Lesson 5: pipeline parallelism -- a GPT cut into stages, the bubble you can see, 3D on a mesh.

    mpirun -n 8 python -m minidist.lessons.pipeline                  # ranks as MPI processes
    python -m minidist.lessons.pipeline --ranks 8                    # ranks as threads
    python -m minidist.lessons.pipeline --ranks 8 --pp 8 --dp 1 --schedule gpipe --microbatches 16
    python -m minidist.lessons.pipeline --ranks 4 --dp 1 --schedule interleaved --chunks 2
    python -m minidist.lessons.pipeline --ranks 4 --dp 1 --schedule zb-h1      # backward split in B and W
    python -m minidist.lessons.pipeline --ranks 4 --dp 1 --schedule zb-v     # two chunks per rank in a V
    python -m minidist.lessons.pipeline --ranks 4 --dp 1 --schedule dualpipe # two model copies, both ends
    mpirun -n 8 python -m minidist.lessons.pipeline --clock virtual  # as 8 devices would run it

Trains a small byte-level GPT on dp x pp x tp ranks with a pipeline schedule, checks the trained
parameters against the serial twin (same batches, one process), and prints (``pipeline_report.py``)
the measured timeline of the last step (one row per stage), the bubble beside its schedule's formula
and the simulator at the op costs the run measured (PASS/FAIL on the virtual clock), and each
stage's peak activation memory. Chapter 5 has every schedule's order.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from minidist import trace
from minidist.lessons.cli import (
    default_device,
    finish,
    first_accepted,
    launch,
    lesson_parser,
    positive_float,
    positive_int,
    reject_early,
    rprint,
    world_size,
)
from minidist.lessons.pipeline_report import memory, own_formula, report
from minidist.nn import GPT, GPTConfig
from minidist.nn.data import BatchLoader, TextDataset
from minidist.nn.serial import adamw_tolerance, max_state_diff, train_serial
from minidist.parallel.pipeline.catalog import SCHEDULES, make_schedule, schedule_chunks
from minidist.parallel.pipeline.partition import format_partition, layer_costs
from minidist.parallel.pipeline.runtime import run_schedule
from minidist.parallel.pipeline.schedule import ScheduleError
from minidist.parallel.three_d import Options, check, gather_full_state, train_mesh


def tolerance(args) -> float:
    """How far the parallel parameters may be from the serial twin's.

    The two differ only in summation order (microbatch and replica partial sums): float32 gets
    ``serial.adamw_tolerance`` (10% of AdamW's largest travel, 0.1 * lr * steps), float64 1e-9.
    """
    return 1e-9 if args.dtype == "float64" else adamw_tolerance(args.lr, args.steps)


def config(args) -> GPTConfig:
    return GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=4, d_model=args.width,
                     dtype=args.dtype, seed=args.seed)


def make_batches(args) -> list:
    """The global batches every rank (and the serial twin) trains on: windows of the shipped text."""
    loader = BatchLoader(TextDataset.from_file(block_size=args.seq), args.batch, seed=args.seed)
    return [loader.next_batch() for _ in range(args.steps)]


def mesh_sizes(world: int, args) -> tuple[int, int, int]:
    """dp, pp, tp; pp defaults to whatever dp and tp leave of the world."""
    dp, tp = args.dp, args.tp
    pp = args.pp if args.pp is not None else max(1, world // (dp * tp))
    return dp, pp, tp


def run_options(world: int, args, microbatches: int | None = None, batch: int | None = None) -> Options:
    """The run's flags as ``parallelize``'s ``Options``, checked (``check``: the mesh, the batch, the
    schedule; a ValueError, or a ScheduleError, names what is wrong)."""
    dp, pp, tp = mesh_sizes(world, args)
    opts = Options(dp=dp, pp=pp, tp=tp, microbatches=microbatches or args.microbatches,
                   schedule=args.schedule, chunks=args.chunks, optimizer="adamw", lr=args.lr)
    return check(opts, config(args), world, batch or args.batch, args.seq)


def checked_options(world: int, args) -> Options:
    """The run's flags, checked once before any rank starts; a schedule that cannot be built is a
    ValueError naming the flag and values that work, found by asking the same rules about nearby
    values (``run_options``: the schedule's and ``check_3d``'s)."""
    try:
        return run_options(world, args)
    except ScheduleError as e:
        rule = str(e)
    dp, pp, tp = mesh_sizes(world, args)
    m = args.microbatches

    def builds(microbatches, schedule=args.schedule):
        make_schedule(schedule, pp, microbatches, args.chunks if schedule == "interleaved" else 1)

    def runs(microbatches, batch=args.batch):
        run_options(world, args, microbatches, batch)

    near = sorted(set(range(1, 2 * (m + pp) + 1)) - {m}, key=lambda k: (abs(k - m), -k))
    fix = first_accepted(runs, near)  # the nearest count that runs with this --batch, else with another
    batch = args.batch
    if fix is None and (fix := first_accepted(builds, near)) is not None:
        batch = first_accepted(lambda b: runs(fix, b), range(args.batch, args.batch + dp * fix + 1))
    if fix is not None:
        alt = f"--microbatches {fix}" + (f" --batch {batch}" if batch not in (None, args.batch) else "")
        raise ValueError(f"argument --microbatches: {m} with --schedule {args.schedule} on pp={pp} "
                         f"stages: {rule}; e.g. {alt}")
    other = first_accepted(lambda name: builds(m, name), ["1f1b", "gpipe"])
    raise ValueError(f"argument --schedule: {args.schedule} on pp={pp} stages: {rule}; e.g. --schedule "
                     f"{other}" + (" --chunks 1" if args.chunks > 1 else ""))


def partition_costs(comm, cfg, batch, args):
    """Per-layer costs for a balanced partition, measured on rank 0 and shared (all ranks must agree)."""
    if args.partition == "uniform":
        return None
    if args.partition == "blocks":  # Megatron-LM's cut: the blocks evenly, embedding and head ride along
        return [0.0] + [1.0] * cfg.n_layer + [0.0]
    costs = None
    if comm.rank == 0:
        rows = args.batch // (args.dp * args.microbatches)
        costs = layer_costs(GPT(cfg), batch[0][:rows], by=args.partition)
    return comm.bcast_obj(costs, root=0)


def step_events(tracer, marks, step) -> list:
    return tracer.events[marks[step]:marks[step + 1]]


def memory_step(result, other: str, batch, args) -> list:
    """One extra step (no update) under schedule `other`; returns this rank's peak activation stats."""
    mesh, stage = result.mesh, result.stage
    rows = args.batch // mesh.dp_size
    x, y = (a[mesh.dp_rank * rows:(mesh.dp_rank + 1) * rows] for a in batch)
    m = args.microbatches
    instructions = make_schedule(other, mesh.pp_size, m)[mesh.pp_rank]
    stats = run_schedule(stage, mesh.pp, instructions, np.split(x, m), np.split(y, m))
    for p in stage.parameters():
        p.grad = None
    return stats


def rank_main(comm, args):
    cfg = config(args)
    dp, pp, tp = mesh_sizes(comm.size, args)
    batches = make_batches(args)
    m = args.microbatches
    rprint(comm, f"Pipeline parallelism: a GPT of {cfg.n_layer + 2} layers (embedding, {cfg.n_layer} blocks, "
                 f"head; d_model {cfg.d_model}, seq {cfg.block_size})\n"
                 f"on {comm.size} ranks ({comm.transport}) = "
                 f"dp {dp} x pp {pp} x tp {tp}; schedule {args.schedule}"
                 + (f" ({args.chunks} chunks per stage)" if args.chunks > 1 else "")
                 + f"; global batch {args.batch} = " + (f"{dp} replicas x " if dp > 1 else "")
                 + f"{m} microbatches of {args.batch // (dp * m)}\n")
    costs = partition_costs(comm, cfg, batches[0], args)
    tracer = trace.current()
    own_tracer = tracer is None
    if own_tracer:  # the lesson always records: it draws the measured timeline
        tracer = trace.Tracer(comm.rank)
        trace.set_current(tracer)
    marks, times, wall = [0], [], []  # step times on the rank's clock (virtual when it runs), and wall
    t_step = [trace.clock.now(), time.perf_counter()]

    def on_step(step, stats):
        marks.append(len(tracer.events))
        now = trace.clock.now(), time.perf_counter()
        times.append(now[0] - t_step[0])
        wall.append(now[1] - t_step[1])
        t_step[:] = now

    try:
        result = train_mesh(comm, cfg, batches, replace(args.options, layer_costs=costs), on_step=on_step)
        # the other one-chunk schedule, for the memory table (an interleaved or V stage has its own
        # chunks: no other schedule runs on it)
        other = (None if schedule_chunks(args.schedule, args.chunks) > 1 or args.schedule == "dualpipe"
                 else "gpipe" if args.schedule == "1f1b" else "1f1b")
        other_stats = memory_step(result, other, batches[-1], args) if other else None
        other_events = tracer.events[marks[-1]:]  # that step's spans: ZB-H1's bubble beside 1F1B's
    finally:
        if own_tracer:
            trace.set_current(None)
    mesh = result.mesh
    uniform = [1.0] * (cfg.n_layer + 2)
    unit = {"time": " s", "params": " B", "blocks": " blocks"}.get(args.partition, " layers")
    placement = getattr(result.stage, "placement", None)  # a V's pieces: which rank holds each
    rprint(comm, f"partition ({args.partition}):\n"
           + format_partition(result.bounds, costs or uniform, unit, placement))
    for step, loss in enumerate(result.losses):
        rprint(comm, f"step {step}: loss {loss:.4f}")

    # -- collect on rank 0: each rank's events of every step, its memory stats, the trained model ---
    mine = {"coords": (mesh.pp_rank, mesh.dp_rank, mesh.tp_rank), "times": times, "wall": wall,
            "virtual": comm.clock is not None, "device": getattr(comm.clock, "device", None) is not None,
            "other": other_events if other == "1f1b" else None,
            "events": [step_events(tracer, marks, s) for s in range(len(batches))],
            "peak": {name: (st.peak_activation_bytes, st.peak_microbatches)
                     for name, st in ((args.schedule, result.stats[-1]), (other, other_stats)) if st},
            "split": {k: getattr(result.stats[-1], k) for k in ("peak_fb_bytes", "peak_weight_queue_bytes",
                                                                 "peak_pending_weights")}}
    everyone = comm.gather_obj(mine, root=0)
    state = gather_full_state(comm, result)
    if comm.rank != 0:
        return finish(comm, True)  # rank 0 judges
    ref_state, ref_losses = train_serial(cfg, batches, lr=args.lr, optimizer="adamw")
    diff, tol = max_state_diff(state, ref_state), tolerance(args)
    loss_diff = float(np.max(np.abs(np.array(result.losses) - ref_losses)))
    passed = diff <= tol and np.isfinite(loss_diff)  # a NaN loss FAILs
    print(f"\nserial twin (one GPT, same {len(batches)} global batches, AdamW): "
          f"max |param diff| = {diff:.2e}, "
          f"max |loss diff| = {loss_diff:.2e} (tolerance {tol:.1e})  {'PASS' if passed else 'FAIL'}")
    other = [r["other"] for r in everyone] if everyone[0]["other"] else None
    bubble, sim, ok = report(everyone, args, pp, m, message_seconds(comm, cfg, args), other)
    memory(everyone, args, pp, m)
    if args.plot:
        events = [e for r in everyone for e in r["events"][-1]]
        rows = {i: f"dp {r['coords'][1]} · stage {r['coords'][0]} · tp {r['coords'][2]}"
                for i, r in enumerate(everyone)}
        trace.plot_timeline(args.plot, events, losses=result.losses, labels=rows, ms=True,
                            title=plot_title(args, pp, m, bubble, sim))
        print(f"wrote {args.plot}")
    return finish(comm, passed and ok)


def plot_title(args, pp: int, m: int, bubble: float, sim: float) -> str:
    """The picture's title: the chosen schedule's measured bubble beside ITS formula and simulator."""
    v = args.chunks
    text, value = own_formula(args.schedule, pp, m, v)
    return (f"{args.schedule}, p={pp}, m={m}" + (f", v={v}" if v > 1 else "")
            + f": bubble measured {bubble:.2f}, simulator {sim:.2f}, formula {text} = {value:.2f}")


def message_seconds(comm, cfg, args) -> float:
    """One activation message's time on the virtual clock's link (alpha + bytes/beta; 0 on the wall
    clock): a microbatch's rows x seq x d_model values."""
    if comm.clock is None:
        return 0.0
    rows = args.batch // (args.dp * args.microbatches)
    nbytes = rows * cfg.block_size * cfg.d_model * np.dtype(args.dtype).itemsize
    return comm.clock.link.alpha + nbytes / comm.clock.link.bandwidth


def virtual_defaults(args, world: int) -> None:
    """Unset flags on the virtual clock take the formula's world: equal stages (3 blocks each, cut by
    blocks) whose ops cost this machine's roofline (``--device here``), not noisy CPU time. The wall
    clock keeps 6 layers cut by count. ``--device cpu-time`` (or a ``MINIDIST_DEVICE`` already set) wins."""
    virtual = default_device(args, "here")
    pp = args.pp or max(1, world // (args.dp * args.tp))
    if args.layers is None:
        args.layers = 3 * pp if virtual else 6
    if args.partition is None:
        args.partition = "blocks" if virtual else "uniform"


def main(argv=None):
    parser = lesson_parser(__doc__, ranks=8)
    parser.add_argument("--dp", type=positive_int, default=2, help="data-parallel replicas")
    parser.add_argument("--pp", type=positive_int, default=None,
                        help="pipeline stages (default: ranks / (dp x tp))")
    parser.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel shards per layer")
    parser.add_argument("--microbatches", type=positive_int, default=8,
                        help="microbatches per replica per step (m)")
    parser.add_argument("--schedule", choices=["interleaved", *SCHEDULES], default="1f1b")
    parser.add_argument("--chunks", type=positive_int, default=None,
                        help="model chunks per stage, interleaved only (default 2 there, 1 otherwise)")
    parser.add_argument("--partition", choices=["uniform", "blocks", "time", "params"], default=None,
                        help="cut by layer count (the default); blocks: the blocks evenly, the embedding and "
                             "head riding along (Megatron-LM; the default on the virtual clock); or balance "
                             "measured time / parameter bytes")
    parser.add_argument("--steps", type=positive_int, default=6)
    parser.add_argument("--batch", type=positive_int, default=32, help="global batch (rows)")
    parser.add_argument("--seq", type=positive_int, default=64)
    parser.add_argument("--layers", type=positive_int, default=None,
                        help="transformer blocks (default 6; on the virtual clock 3 per stage)")
    parser.add_argument("--width", type=positive_int, default=128, help="d_model, a multiple of the 4 heads")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--lr", type=positive_float, default=3e-3)
    parser.add_argument("--width-chars", type=positive_int, default=100, help="columns of the ASCII timeline")
    args = parser.parse_args(argv)
    world = world_size(args)
    virtual_defaults(args, world)
    if args.chunks is None:
        args.chunks = 2 if args.schedule == "interleaved" else 1
    if args.chunks > 1 and args.schedule != "interleaved":
        parser.error(f"--chunks {args.chunks} needs --schedule interleaved (the other schedules fix their "
                     "chunks: one per stage, two in a V for zb-v and dualpipe-v)")
    # every mesh, batch, microbatch and schedule error, checked once before any rank starts
    reject_early(parser, lambda: setattr(args, "options", checked_options(world, args)))
    return launch(rank_main, args)


if __name__ == "__main__":
    from minidist.lessons.cli import run_lesson

    run_lesson(main)
