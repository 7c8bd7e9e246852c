"""Lesson 11: choose your mesh -- the planner predicts, the ranks measure.

    python -m minidist.lessons.planning --ranks 8            # ranks as threads
    mpirun -n 8 python -m minidist.lessons.planning          # ranks as MPI processes
    python -m minidist.lessons.planning --ranks 8 --choice 4 # train the 4th-ranked mesh instead
    python -m minidist.lessons.planning --ranks 8 --clock virtual --link nvlink --device h100  # a cluster

Asks the planner (`minidist.plan`) for the best way to train a small GPT on this machine's ranks
(`--hardware here`: the constants `python -m minidist.calibrate` measured; run once if missing),
prints its ranked candidates, then trains the winner with `train_3d` and prints predicted beside
measured: bytes each rank sent per step (the ledger), activation and parameter bytes (the memory
accountant), and the step time (`trace.clock.now()`). Checks: bytes and memory equal the prediction
exactly, the trained parameters equal the serial twin's. Under `--clock virtual --device NAME` the
planner plans for the emulated cluster (that device, every axis on `--link`) and its step time must
match the clock's within 10% (PASS/FAIL); otherwise it is a 30% target, MET or MISSED (a shared
machine's timing is no pass/fail matter). `--plot FILE.png` draws the planner's memory bars and time
breakdown; `--trace FILE.json` the ranks' timelines.
"""

from __future__ import annotations

import os
import time

import numpy as np

from minidist import trace
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
    hw = planner_hardware(comm)
    cands = [c for c in candidates(model, comm.size, args.batch, hw, zero=(0,), checkpoints=("none", "full"),
                                   microbatch_sizes=(1, 2, 4)) if c.schedule == "1f1b"]
    preds = plan(model, comm.size, args.batch, hw, Settings("adamw"), top=6, cands=cands)
    where = (f"{cores_for(hw, comm.size):.1f} cores' worth free to them" if comm.clock is None else
             "each its own chip, every axis on the clock's link")
    rprint(comm, f"{model.name}: {model.params():,} parameters, batch {args.batch} x {args.seq} tokens, "
                 f"{comm.size} ranks on {hw.name}, {where}")
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
    marks, charged = [], charge_meter(comm.clock)
    with measure(comm) as meas, progress(total=len(data), desc="train", rank=comm.rank) as bar:
        def on_step(step, stats):
            marks.append((trace.clock.now(), comm.ledger.bytes_sent, len(meas.calls), charged[0]))
            bar.update(1)
        try:
            res = train_3d(comm, cfg, data, dp=c.dp, pp=c.pp, tp=c.tp, microbatches=m, optimizer="adamw",
                           lr=1e-3, on_step=on_step,
                           recompute=None if c.checkpoint == "none" else c.checkpoint)
        finally:
            if len(charged) > 1:
                del comm.clock.work  # the clock's own method again
        calls = meas.calls[marks[0][2]:marks[1][2]]
    mesh = res.mesh
    mine = {"where": (mesh.pp_rank, mesh.dp_rank, mesh.tp_rank), "sent": marks[1][1] - marks[0][1],
            "calls": sorted((x.name, x.bytes_sent) for x in calls),
            "act": res.stats[-1].peak_activation_bytes,
            "params": MemoryAccountant().report(res.stage)["params"],
            "step": step_time(np.diff([t for t, *_ in marks]), comm.clock),
            "compute": float(np.median(np.diff([w for *_, w in marks])[1:]))}
    everyone = comm.gather_obj(mine, root=0)
    state = gather_full_state(comm, res)
    ok = True
    if comm.rank == 0:
        ok = report(args, cfg, model, best, everyone, state, data, hw, comm.clock)
    return finish(comm, ok)


def step_time(steps, clock) -> float:
    """One step's seconds from the steps after the first (which warms up). Wall clock: their median.
    Virtual clock: the mean of the last even number of them -- a ring's peers that finish the backward
    at different times settle into long and short steps by turns, and a pair of them is the period."""
    if clock is None:
        return float(np.median(steps[1:]))
    return float(np.mean(steps[len(steps) % 2:]))


def charge_meter(clock) -> list:
    """[seconds]: the compute a device model's virtual clock has charged this rank so far (every op's
    roofline time), kept up to date while the run lasts; [0.0] with no device model."""
    charged = [0.0]
    if clock is None or clock.device is None:
        return charged
    work, device = clock.work, clock.device

    def counted(flops, nbytes):
        charged[0] += device.op_time(flops, nbytes)
        work(flops, nbytes)
    clock.work = counted
    charged.append(work)
    return charged


def planner_hardware(comm) -> hardware.Hardware:
    """What the planner plans for. Wall clock: this machine as calibrated, its ranks sharing its
    cores. Virtual clock: the cluster the clock emulates -- every axis on the clock's link (its alpha
    and beta), a chip or core per rank, and compute on ``--device``'s roofline (the clock's FLOP/s,
    bytes/s and cost per op, efficiency already in them) or, in CPU time, this machine's kernels."""
    transport, clock = "mpi" if under_mpi() else "threads", comm.clock
    if clock is None:
        return hardware.here(transport=transport)
    link = hardware.Link(clock.link.bandwidth, clock.link.alpha, "the virtual clock's link")
    alone = dict(intra=link, inter=link, chips_per_domain=10**6, cores=0, cores_crowded=0, cpus=0, gil=False,
                 crowds=(), threads=(), cores_one=0)
    dev = clock.device
    if dev is None:
        here = hardware.here(transport=transport)
        return here.with_(name=f"{here.name}, in CPU time", **alone)
    preset = next((h for h in hardware.PRESETS.values() if h.name == dev.name), hardware.H100)
    return preset.with_(name=dev.name or "device", peak_flops=dev.flops, hbm_bandwidth=dev.bandwidth,
                        gemm_efficiency=1.0, op_overhead=dev.overhead, kernels=None, transport=transport,
                        **alone)


def report(args, cfg, model, best, everyone, state, data, hw, clock=None) -> bool:
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
    ok &= step_check(best.step, step, clock, hw, len(everyone))
    if clock is not None and clock.device is not None:
        busy = max(r["compute"] for r in everyone)
        print(f"  of which compute (the busiest rank's ops): planner {best.compute * 1e6:.2f} us, "
              f"the clock's roofline op by op {busy * 1e6:.2f} us; the rest (messages, waits, update): "
              f"planner {(best.step - best.compute) * 1e6:.2f} us, emulated {(step - busy) * 1e6:.2f} us")
    print(f"bytes and memory: {'PASS' if ok else 'FAIL'} (exact)")
    return ok


STEP_TOLERANCE = 0.10  # planner vs a device model's clock: why 10%, chapter 11 "On the virtual clock"


def step_check(predicted: float, measured: float, clock, hw, ranks: int) -> bool:
    """Print predicted vs measured step time and the ratio. On a device model's virtual clock the two
    must agree within STEP_TOLERANCE (PASS/FAIL: the clock is deterministic); in CPU time or wall time
    it is a 30% target, MET or MISSED. Returns False only on a FAIL."""
    ratio = predicted / measured
    if clock is not None and clock.device is not None:
        good = abs(ratio - 1) <= STEP_TOLERANCE
        print(f"step time: predicted {predicted * 1e6:.2f} us, emulated ({clock.device.name} on the virtual "
              f"clock) {measured * 1e6:.2f} us, ratio {ratio:.3f}: within {STEP_TOLERANCE:.0%} "
              f"{'PASS' if good else 'FAIL'}")
        return good
    met = "MET" if abs(ratio - 1) <= 0.3 else "MISSED"
    if clock is not None:
        print(f"step time: predicted {predicted * 1e3:.2f} ms, emulated (CPU time on the virtual clock) "
              f"{measured * 1e3:.2f} ms, ratio {ratio:.2f} -> {met} the 30% target")
    else:
        print(f"step time: predicted {predicted * 1e3:.1f} ms, measured median {measured * 1e3:.1f} ms, "
              f"ratio {ratio:.2f} -> {met} the 30% target (load average now {os.getloadavg()[0]:.1f}, "
              f"{cores_for(hw, ranks):.1f} cores' worth free to the {ranks} ranks)")
    return True


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
    if not args.device:  # a device model needs no calibration of this machine
        ensure_calibrated()
    return launch(rank_main, args)


if __name__ == "__main__":
    from minidist.lessons.cli import run_lesson

    run_lesson(main)
