"""Lesson 11: choose your mesh -- the planner predicts, the ranks measure.

    python -m minidist.lessons.planning --ranks 8            # ranks as threads
    mpirun -n 8 python -m minidist.lessons.planning          # ranks as MPI processes
    python -m minidist.lessons.planning --ranks 8 --choice 4 # train the 4th-ranked mesh instead

Asks the planner (`minidist.plan`) for the best way to train a small GPT on this machine's ranks
(`--hardware here`: the constants `python -m minidist.calibrate` measured; run once if missing),
prints its ranked candidates, then trains the winner with `train_3d` and prints predicted beside
measured: bytes each rank sent per step (the ledger), activation and parameter bytes (the memory
accountant), and the step time. Checks: bytes and memory equal the prediction exactly, and the
trained parameters equal the serial twin's. The step time is compared with a 30% target and
printed MET or MISSED (a shared machine's timing is not a pass/fail matter). `--plot FILE.png`
draws the planner's memory bars and time breakdown; `--trace FILE.json` the ranks' timelines.
"""

from __future__ import annotations

import os
import time

import numpy as np

from minidist.comm import measure, under_mpi
from minidist.lessons.cli import finish, launch, lesson_parser, positive_int, rprint, world_size
from minidist.lessons.progress import progress
from minidist.nn import GPTConfig
from minidist.nn.footprint import MemoryAccountant
from minidist.nn.serial import adamw_tolerance, max_state_diff, train_serial
from minidist.parallel.three_d import gather_full_state, train_3d
from minidist.plan import ModelSpec, Settings, collectives, hardware, memory, plan
from minidist.plan.__main__ import plot, table
from minidist.plan.calibrate import calibrate
from minidist.plan.mesh import stage_activation_peak, stage_param_counts
from minidist.plan.search import candidates
from minidist.plan.steptime import rank_slowdown


def config(args) -> GPTConfig:
    return GPTConfig(vocab_size=64, block_size=args.seq, n_layer=args.layers, n_head=4, d_model=args.width,
                     seed=args.seed)


def spec(args) -> ModelSpec:
    return ModelSpec("lesson-gpt", n_layer=args.layers, d_model=args.width, n_head=4, vocab=64, seq=args.seq,
                     engine="minidist", dtype_bytes=4)


def make_batches(args) -> list:
    rng = np.random.default_rng(args.seed)
    return [(rng.integers(0, 64, (args.batch, args.seq)), rng.integers(0, 64, (args.batch, args.seq)))
            for _ in range(args.steps)]


def rank_main(comm, args):
    cfg, model = config(args), spec(args)
    hw = hardware.here(transport="mpi" if under_mpi() else "threads")
    cands = [c for c in candidates(model, comm.size, args.batch, hw, zero=(0,), checkpoints=("none", "full"),
                                   microbatch_sizes=(1, 2, 4)) if c.schedule == "1f1b"]
    preds = plan(model, comm.size, args.batch, hw, Settings("adamw"), top=6, cands=cands)
    rprint(comm, f"{model.name}: {model.params():,} parameters, batch {args.batch} x {args.seq} tokens, "
                 f"{comm.size} ranks on {hw.name}, {cores_for(hw, comm.size):.1f} cores' worth free to them")
    rprint(comm, table(preds, 6, args.batch, hw))
    if args.plot and comm.rank == 0:
        plot(preds, args.plot, 6, hw.hbm_bytes)
        print(f"wrote {args.plot}: memory by kind and the time breakdown of the 6 best", flush=True)
    best = preds[args.choice - 1] if args.choice <= len(preds) else preds[0]
    c = best.cand
    m = c.microbatches(args.batch)
    which = "best" if best is preds[0] else f"#{args.choice}"
    rprint(comm, f"\ntraining the planner's {which}: {c.label()} ({m} microbatches per replica)")
    data = make_batches(args)
    marks = []
    with measure(comm) as meas, progress(total=len(data), desc="train", rank=comm.rank) as bar:
        def on_step(step, stats):
            marks.append((time.perf_counter(), comm.ledger.bytes_sent, len(meas.calls)))
            bar.update(1)
        res = train_3d(comm, cfg, data, dp=c.dp, pp=c.pp, tp=c.tp, microbatches=m, optimizer="adamw",
                       lr=1e-3, on_step=on_step, recompute=None if c.checkpoint == "none" else c.checkpoint)
        calls = meas.calls[marks[0][2]:marks[1][2]]
    mesh = res.mesh
    mine = {"where": (mesh.pp_rank, mesh.dp_rank, mesh.tp_rank), "sent": marks[1][1] - marks[0][1],
            "calls": sorted((x.name, x.bytes_sent) for x in calls),
            "act": res.stats[-1].peak_activation_bytes,
            "params": MemoryAccountant().report(res.stage)["params"],
            "step": float(np.median(np.diff([t for t, _, _ in marks])[1:]))}
    everyone = comm.gather_obj(mine, root=0)
    state = gather_full_state(comm, res)
    ok = True
    if comm.rank == 0:
        ok = report(args, cfg, model, best, everyone, state, data, hw)
    return finish(comm, ok)


def report(args, cfg, model, best, everyone, state, data, hw) -> bool:
    c = best.cand
    print(f"\n{'rank (stage,dp,tp)':<20} {'bytes sent/step':>30} {'activations peak':>30} {'params':>22}")
    ok, checked = True, 0
    for r in everyone:
        stage, dpr, tpr = r["where"]
        pred_calls = collectives(model, c, args.batch, stage, dp_rank=dpr, tp_rank=tpr)
        sent = sum(x.sent * x.count for x in pred_calls)
        want = sorted((x.name, int(x.sent)) for x in pred_calls if x.axis != "pp" for _ in range(x.count))
        act = stage_activation_peak(model, c, args.batch, stage, Settings(), recompute=False)
        params = 4 * stage_param_counts(model, c, stage)[0]
        same = sent == r["sent"] and want == r["calls"] and act == r["act"] and params == r["params"]
        ok &= same
        checked += 1
        if (dpr or tpr) and same:
            continue  # print one rank per stage, and any rank that differs
        print(f"{str(r['where']):<20} {r['sent']:>14,} (pred {int(sent):>10,}) {r['act']:>14,} "
              f"(pred {int(act):>10,}) {r['params']:>8,} (pred {params:>8,})  {'PASS' if same else 'FAIL'}")
    print(f"every one of the {checked} ranks: bytes, calls, activations and parameters "
          f"{'equal the prediction' if ok else 'DIFFER (see FAIL rows)'}")
    full = memory(model, c, args.batch)
    print("predicted memory of the fullest rank: " +
          ", ".join(f"{k} {full[k]:,.0f} B" for k in ("params", "grads", "optimizer", "activations")))
    ref, _ = train_serial(cfg, data, lr=1e-3, optimizer="adamw")
    diff = max_state_diff(state, ref)
    tol = adamw_tolerance(1e-3, args.steps)
    twin = diff <= tol
    ok &= twin
    print(f"serial twin: max |parallel - serial| = {diff:.2e} (tolerance {tol:.0e}) "
          f"{'PASS' if twin else 'FAIL'}")
    step = max(r["step"] for r in everyone)
    ratio = best.step / step
    print(f"step time: predicted {best.step * 1e3:.1f} ms, measured median {step * 1e3:.1f} ms, ratio "
          f"{ratio:.2f} -> {'MET' if abs(ratio - 1) <= 0.3 else 'MISSED'} the 30% target "
          f"(load average now {os.getloadavg()[0]:.1f}, {cores_for(hw, len(everyone)):.1f} cores' worth free "
          f"to the {len(everyone)} ranks)")
    print(f"bytes and memory: {'PASS' if ok else 'FAIL'} (exact)")
    return ok


def cores_for(hw, ranks: int) -> float:
    """The cores' worth of work `ranks` ranks get together here (the planner's `rank_slowdown`)."""
    return ranks / rank_slowdown(hw, ranks) if hw.cores else float(ranks)


def ensure_calibrated() -> None:
    """Measure this machine once (rank 0 under MPI; the others wait asleep, not in MPI's spinning
    barrier, so the calibration -- and its own mpirun probe -- sees the cores free)."""
    if os.path.exists(hardware.CALIBRATION_PATH):
        return
    world = None
    if under_mpi():
        from mpi4py import MPI

        world = MPI.COMM_WORLD
    if world is None or world.Get_rank() == 0:
        print("calibrating this machine once (python -m minidist.calibrate) ...", flush=True)
        calibrate()
    if world is not None:
        done = world.Ibarrier()
        while not done.Test():
            time.sleep(0.01)


def main(argv=None):
    parser = lesson_parser(__doc__, ranks=8)
    parser.add_argument("--steps", type=positive_int, default=4)
    parser.add_argument("--batch", type=positive_int, default=16, help="global batch (rows)")
    parser.add_argument("--seq", type=positive_int, default=32)
    parser.add_argument("--layers", type=positive_int, default=4, help="transformer blocks")
    parser.add_argument("--width", type=positive_int, default=64, help="d_model, a multiple of the 4 heads")
    parser.add_argument("--choice", type=positive_int, default=1,
                        help="train the planner's N-th ranked mesh instead of its best (to see pp, tp)")
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error("--steps must be >= 3: the first step is a warm-up, the next ones are measured")
    if args.batch % world_size(args):
        parser.error(f"--batch {args.batch} must be a multiple of the {world_size(args)} ranks")
    ensure_calibrated()
    return launch(rank_main, args)


if __name__ == "__main__":
    from minidist.lessons.cli import run_lesson

    run_lesson(main)
