"""Pipeline schedules measured against their formulas and against the simulator's prediction.

    python benchmarks/pipeline.py                 # p = 2 and 4 under mpirun (one process a stage),
                                                  # p = 8 simulated; m = 4, 8, 16; ~2-3 min
    python benchmarks/pipeline.py --quick         # p = 2, m = 4, a tiny GPT on thread ranks (seconds)
    python benchmarks/pipeline.py --transport threads --stages 2 4
    python benchmarks/pipeline.py --clock virtual --device here --stages 4 --microbatches 8 --layers 12

For each p and m, every schedule the runtime can build (`minidist.plan.schedules.SCHEDULES`) trains
the same GPT for a few steps (AdamW), cut where the simulator at the layers' measured costs runs
that schedule fastest (`cut_for_schedule`; `--cut time`: the ranks' loads balanced, `partition_for`;
`--cut uniform`: by layer count). Before the runs each stage times its own F, B, W and optimizer
step (`time_fbw`). Each row prints the measured bubble beside the formula and the simulator's, each
stage's peak activations beside the formula, and the step time beside `predict_step` and as a
speed-up over 1F1B, judged MET or MISSED (chapter 5, "Measured against the formulas", says how).
p = 8 is simulated only. `--clock virtual` (with `--link`, `--device`, as the lessons) times the runs
on each rank's virtual clock and adds the issue-42 targets: 1F1B's bubble within 0.03 of
(p-1)/(m+p-1) (under a device model), every schedule's within 0.03 of the simulator fed the op costs
the run measured, ZB-H1's below 1F1B's. Prints the CPU, BLAS and load average (bench_env); exits
nonzero on a miss only with --strict.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np

from minidist import trace
from minidist.comm import run, under_mpi
from minidist.lessons.cli import use_clock
from minidist.nn import GPT, GPTConfig
from minidist.nn.optim import AdamW
from minidist.parallel.pipeline.partition import layer_costs, partition_for, partition_uniform, rank_loads
from minidist.parallel.pipeline.placement import looped, placement_of
from minidist.parallel.pipeline.runtime import run_schedule
from minidist.parallel.pipeline.simulate import bubble_formula, measured_costs, peak_activations, simulate
from minidist.parallel.pipeline.stage import PipelineStage
from minidist.plan import schedules
from minidist.plan.pipeline_costs import Costs, busiest, cut_for_schedule, predict_step, stage_input, time_fbw

BUBBLE_SLACK, MEMORY_SLACK, STEP_SLACK = 0.05, 0.10, 0.15
BUSY = ("Forward", "Backward", "BackwardInput", "BackwardWeight")


def runnable(p: int, m: int, n_layers: int) -> list[tuple]:
    """(model, chunks, instruction lists) of each schedule the runtime builds for p stages, m microbatches."""
    out = []
    for sched in schedules.SCHEDULES.values():
        v = sched.chunks or (2 if sched.name == "interleaved" else 1)
        if v * p > n_layers:
            continue
        try:
            lists = schedules.build(sched.name, p, m, v)
        except ValueError:  # ScheduleError: too few microbatches for it
            continue
        if lists is not None:
            out.append((sched, v, lists))
    return out


def timed_steps(comm, stage, instructions, xs, ys, steps: int):
    """Per step: this rank's seconds, its events; and the last step's StepStats."""
    opt = AdamW(stage.parameters(), lr=1e-4)

    def update():
        opt.step()
        opt.zero_grad()
    tracer, times, events, stats = trace.Tracer(comm.rank), [], [], None
    for _ in range(steps):
        comm.barrier()  # every step starts together, as the simulated one does
        start, t0 = len(tracer.events), trace.clock.now()  # the rank's clock: virtual when it runs
        with trace.tracing(tracer):
            stats = run_schedule(stage, comm, instructions, xs, ys, optimizer_step=update)
        times.append(trace.clock.now() - t0)
        events.append(tracer.events[start:])
    return times, events, stats


def optimizer_seconds(stage, repeats: int = 3) -> float:
    opt = AdamW(stage.parameters(), lr=1e-4)
    ts = []
    for _ in range(repeats):
        for p in stage.parameters():
            p.grad = np.zeros_like(p.data)
        t0 = time.perf_counter()
        opt.step()
        ts.append(time.perf_counter() - t0)
    for p in stage.parameters():
        p.grad = None
    return float(np.median(ts))


def measure(comm, cfg, ids, tgt, m: int, args) -> dict:
    """One m on these p ranks: each stage's F, B, W and update, then every runnable schedule timed."""
    p, rank = comm.size, comm.rank
    rows = len(ids) // m
    model = GPT(cfg)
    n = len(list(model))
    # one rank times the layers (all cut alike); the simulator prices each cut's pieces by them
    per_layer = comm.bcast_obj(layer_costs(GPT(cfg), ids[:rows]) if rank == 0 else None)

    def cut(placement, lists=None):
        if args.cut == "uniform":
            return partition_uniform(n, placement.num_virtual)
        if args.cut == "sim" and lists is not None:
            return cut_for_schedule(per_layer, lists, costs)
        return partition_for(per_layer, placement)
    bounds = cut(looped(p))
    stage = PipelineStage(model, bounds, rank, p)
    x = stage_input(model, bounds[rank][0], ids[:rows])
    comm.barrier()
    mine = (time_fbw(stage, x, tgt[:rows], repeats=args.repeats), optimizer_seconds(stage))
    everyone = comm.allgather_obj(mine)
    costs, opt = busiest([c for c, _ in everyone]), max(o for _, o in everyone)
    xs, ys = np.split(ids, m), np.split(tgt, m)
    out = {"costs": [c for c, _ in everyone], "opt": opt, "rows": [], "layers": per_layer, "cuts": {},
           "cut": args.cut}
    for sched, v, lists in runnable(p, m, n):
        where = placement_of(lists)
        out["cuts"][sched.name] = bounds = cut(where, lists)
        st = PipelineStage(GPT(cfg), bounds, rank, p, placement=where)
        first = any(st.is_first(c) for c in range(where.chunks))
        last = any(st.is_last(c) for c in range(where.chunks))
        times, events, stats = timed_steps(comm, st, lists[rank], xs if first else None, ys if last else None,
                                           args.steps)
        one_mb = sum(b for (mb, _), b in stats.activation_bytes.items() if mb == 0)
        # microbatches held from F to B (M_B) at the peak: bytes over one microbatch's; chunks saving
        # unequal bytes (the embedding's beside a block's): the (mb, chunk) pairs held, v to a microbatch
        held = stats.peak_fb_bytes / max(one_mb, 1) if where.chunks == 1 else stats.peak_microbatches / v
        gathered = comm.gather_obj((times, events, held, stats.peak_pending_weights), root=0)
        if rank != 0:
            continue
        step = float(np.median([max(g[0][s] for g in gathered) for s in range(1, args.steps)]))
        scale = piece_scale(per_layer, bounds, where)
        sim = predict_step(lists, costs if sched.split else Costs(costs.F, costs.backward, 0.0), v,
                           opt_time=opt * sched.params, piece_scale=scale)
        ran = busiest([in_run_costs(g[1], v) for g in gathered])
        again = predict_step(lists, ran, v, opt_time=opt * sched.params, piece_scale=scale).makespan
        out["rows"].append({"sched": sched, "v": v, "step": step, "pred": sim.makespan, "pred_run": again,
                            "ran": ran, "op_sim": op_simulated([g[1] for g in gathered], lists,
                                                               message_seconds(comm, cfg, rows)),
                            "bubble": trace.median_bubble([g[1] for g in gathered], skip=1, names=BUSY),
                            "sim_bubble": sim.bubble, "held": [g[2] for g in gathered],
                            "pending": [g[3] for g in gathered]})
    return out


def message_seconds(comm, cfg, rows: int) -> float:
    """One activation message on the virtual clock's link (alpha + bytes/beta); 0 on the wall clock."""
    if comm.clock is None:
        return 0.0
    return comm.clock.link.alpha + rows * cfg.block_size * cfg.d_model * 4 / comm.clock.link.bandwidth


def op_simulated(steps_per_rank, lists, comm_time: float) -> float:
    """The simulator's bubble with every F, B, W at the cost the run measured for it (each step's own
    spans, `measured_costs`), messages in the background as the runtime's; median over the steps
    after the first, as the measured bubble."""
    n = len(steps_per_rank[0])
    bubbles = []
    for s in range(min(1, n - 1), n):
        spans = [e for steps in steps_per_rank for e in steps[s]]
        sim = simulate(lists, op_time=measured_costs(spans), comm_time=comm_time, buffered_sends=True)
        bubbles.append(trace.bubble_fraction([e for e in sim.events if e["name"] in BUSY]))
    return float(np.median(bubbles))


def virtual_targets(p: int, m: int, res: dict, targets) -> None:
    """The virtual clock's targets: 1F1B against (p-1)/(m+p-1) under a device model (ops priced by their
    shapes; in CPU time against its simulator), every schedule against the simulator at the op costs
    it ran at, ZB-H1 below 1F1B."""
    device = os.environ.get("MINIDIST_DEVICE", "")
    exact = bool(device)
    print(f"virtual clock, p = {p}, m = {m} (ops {'priced by ' + device if exact else 'in CPU time'}):")
    print(f"{'schedule':<12} {'bubble':>6} {'sim at its op costs':>19} {'1F1B (p-1)/(m+p-1)':>18}")
    base = None
    for r in res["rows"]:
        s, name = r["sched"], r["sched"].name + (f"x{r['v']}" if r["sched"].name == "interleaved" else "")
        print(f"{name:<12} {r['bubble']:>6.3f} {r['op_sim']:>19.3f} {bubble_formula(p, m):>18.3f}")
        if s.name == "1f1b":
            base = r["bubble"]
            if exact:
                targets.check(f"p={p} m={m} 1F1B |bubble - formula|", abs(r["bubble"] - bubble_formula(p, m)),
                              "<=", 0.03)
                continue
        targets.check(f"p={p} m={m} {name} |bubble - sim|", abs(r["bubble"] - r["op_sim"]), "<=", 0.03)
    zb = next((r for r in res["rows"] if r["sched"].name == "zb_h1"), None)
    if zb is not None and base is not None:
        targets.check(f"p={p} m={m} ZB-H1 bubble - 1F1B's", zb["bubble"] - base, "<=", -1e-9)


def piece_scale(per_layer, bounds, where):
    """Each piece's share of the busiest rank's costs (its pieces summing to `chunks`), for the
    simulator: the stage costs are the busiest rank's, and a cut's pieces are unequal (a uniform
    one's too: the embedding and the head are not blocks)."""
    busiest_load = max(rank_loads(bounds, per_layer, where))
    return [sum(per_layer[a:b]) * where.chunks / busiest_load for a, b in bounds]


def in_run_costs(steps: list, v: int = 1) -> Costs:
    """One stage's F, B, W as its own run timed them (mean span of each, steps after the first, x v
    chunks a span of one chunk; a whole Backward counts as B): what the costs timed before the run
    became under the run's load."""
    spans = {}
    for events in steps[1:]:
        for e in events:
            spans.setdefault(e["name"], []).append(e["t1"] - e["t0"])

    def mean(name):
        return float(np.mean(spans[name])) if name in spans else 0.0
    B = mean("BackwardInput") or mean("Backward")
    return Costs(v * mean("Forward"), v * B, v * mean("BackwardWeight"))


def formula_bubble(sched, p, m, v, c: Costs) -> float:
    return sched.bubble_fraction(p, m, c.F, c.B, c.W, v) if sched.split else \
        sched.bubble_fraction(p, m, c.F, c.backward, 0.0, v)


def report(p: int, m: int, res: dict, targets) -> None:
    """One table for p, m. The formula's bubble and the simulator's step time are judged at the F, B,
    W the run itself timed (`in_run_costs`): on a shared machine the costs timed before the run are
    not the ones it ran at (their prediction is shown as `pred(pre)`). With more stages than cores
    a rank also waits for a core, which no formula here models: such rows are shown, not judged."""
    cores = os.cpu_count() or 1
    virtual = os.environ.get("MINIDIST_CLOCK") == "virtual"
    judged = p <= cores and not virtual
    per = " ".join(f"{k.F * 1e3:.1f}/{k.B * 1e3:.1f}/{k.W * 1e3:.1f}" for k in res["costs"])
    print(f"\np = {p}, m = {m}: F/B/W ms per stage timed before the runs {per}; "
          f"optimizer {res['opt'] * 1e3:.1f} ms"
          + ("\n(virtual clock: the wall-clock costs timed before the runs do not price its steps; bubble "
             "and step time shown here, judged in the virtual clock's table below)" if virtual else
             "" if judged else f"\n({p} stages on {cores} cores: bubble and step time shown, not judged)"))
    print(f"cut by {'layer count' if res['cut'] == 'uniform' else 'measured layer costs'} (layers, ms: "
          + " ".join(f"{c * 1e3:.1f}" for c in res["layers"]) + "): " + "; ".join(
        f"{where} {' '.join(f'{a}-{b - 1}' for a, b in bounds)}" for where, bounds in res["cuts"].items()))
    print("(held: microbatches from F to B per stage, the paper's M_B; W: from B to W, its M_W, apart)")
    print(f"{'schedule':<12} {'bubble':>6} {'formula':>7} {'sim':>5}      {'held per stage / formula':<34}"
          f"      {'step ms':>7} {'pred':>6} {'ratio':>5}      {'vs 1F1B':>7} {'pred':>5}  {'pred(pre)':>9}")
    base = next((r for r in res["rows"] if r["sched"].name == "1f1b"), None)
    for r in res["rows"]:
        s, v = r["sched"], r["v"]
        f = formula_bubble(s, p, m, v, r["ran"])
        held = []
        ok_mem = True
        for stage, got in enumerate(r["held"]):
            want = s.stage_peak(p, m, v, stage)
            held.append(f"{got:.1f}/{'?' if want is None else f'{want:g}'}")
            if want is not None:  # a split schedule's formula is a bound (ZB-H2's, ZB-V's: stage 0's)
                bound = got <= want * (1 + MEMORY_SLACK)
                ok_mem &= bound if s.split else abs(got - want) <= MEMORY_SLACK * want
        if s.split and any(r["pending"]):
            wants = [s.stage_pending(p, m, v, stage) for stage in range(p)]
            held.append("W " + " ".join(f"{got}/{'?' if w is None else w}"
                                        for got, w in zip(r["pending"], wants)))
            ok_mem &= all(w is None or got == w for got, w in zip(r["pending"], wants))
        ok_b = abs(r["bubble"] - f) <= BUBBLE_SLACK
        ratio = r["step"] / r["pred_run"]
        ok_t = abs(ratio - 1) <= STEP_SLACK
        speed = (f"{base['step'] / r['step']:>6.2f}x {base['pred_run'] / r['pred_run']:>5.2f}x"
                 if base else "")
        name = s.name + (f"x{v}" if s.name == "interleaved" else "")
        mark_b, mark_t = (_mark(ok_b), _mark(ok_t)) if judged else ("shown ", "shown ")
        print(f"{name:<12} {r['bubble']:>6.3f} {f:>7.3f} {max(0.0, r['sim_bubble']):>5.3f} {mark_b}  "
              f"{' '.join(held):<34} {_mark(ok_mem)}  {r['step'] * 1e3:>7.1f} {r['pred_run'] * 1e3:>6.1f} "
              f"{ratio:>5.2f} {mark_t}  {speed}  {r['pred'] * 1e3:>9.1f}")
        checks = ((ok_b or not judged, "bubble"), (ok_mem, "memory"), (ok_t or not judged, "step time"))
        for ok, what in checks:
            if not ok:
                targets.missed.append(f"p={p} m={m} {name} {what}")


def _mark(ok: bool) -> str:
    return "MET   " if ok else "MISSED"


def simulated(p_run: int, res_by_m: dict, p: int = 8) -> None:
    """p = 8 from the run's stage costs: each of 8 stages holds p_run/8 of the layers a run's stage held."""
    print(f"\np = {p}, simulated (stage costs of the p = {p_run} run x {p_run}/{p}):")
    print(f"{'m':>3} {'schedule':<12} {'sim bubble':>10} {'formula':>7}  {'held stage 0':>12} "
          f"{'formula':>7}  {'pred ms':>8} {'vs 1F1B':>7}")
    for m, res in res_by_m.items():
        c = busiest(res["costs"])
        c = Costs(c.F * p_run / p, c.B * p_run / p, c.W * p_run / p)
        base = None
        for sched, v, lists in runnable(p, m, p * 2):
            sim = predict_step(lists, c if sched.split else Costs(c.F, c.backward, 0.0), v,
                               opt_time=res["opt"] * sched.params)
            base = sim.makespan if sched.name == "1f1b" else base
            held = peak_activations(lists[0]) / v
            name = sched.name + (f"x{v}" if sched.name == "interleaved" else "")
            print(f"{m:>3} {name:<12} {sim.bubble:>10.3f} {formula_bubble(sched, p, m, v, c):>7.3f}  "
                  f"{held:>12g} {sched.peak(p, m, v):>7g}  {sim.makespan * 1e3:>8.1f} "
                  f"{(base or sim.makespan) / sim.makespan:>6.2f}x")


def bench(comm, args):
    cfg = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=4, d_model=args.width)
    rng = np.random.default_rng(0)
    ids, tgt = (rng.integers(0, 256, (args.batch, args.seq)) for _ in range(2))
    if comm.rank == 0:
        from bench_env import print_machine

        print_machine()
        print(f"GPT {cfg.n_layer} blocks (+ embedding, head), d_model {cfg.d_model}, seq {cfg.block_size}, "
              f"batch {args.batch}; p = {comm.size} ranks ({comm.transport}) on {os.cpu_count()} cores; "
              f"median of {args.steps - 1} steps after a warm-up")
    results = {m: measure(comm, cfg, ids, tgt, m, args) for m in args.microbatches}
    if comm.rank != 0:
        return 0
    from bench_env import Targets

    targets = Targets()
    for m, res in results.items():
        report(comm.size, m, res, targets)
        if comm.clock is not None:
            virtual_targets(comm.size, m, res, targets)
    if comm.size == max(args.stages) and args.simulate:
        simulated(comm.size, results)
    return targets.exit_code(args.strict)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4], help="p values to run")
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--transport", choices=("mpi", "threads"), default="mpi")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--cut", choices=("sim", "time", "uniform"), default="sim",
                    help="the model's cut: the one each schedule's simulation at the measured layer costs "
                         "runs fastest; the ranks' loads balanced (partition_for); or by layer count")
    ap.add_argument("--repeats", type=int, default=5, help="microbatches timed for each of F, B, W")
    ap.add_argument("--no-simulate", dest="simulate", action="store_false", help="skip the p = 8 table")
    ap.add_argument("--quick", action="store_true", help="p = 2, m = 4, a tiny GPT on thread ranks")
    ap.add_argument("--strict", action="store_true", help="exit nonzero when a target is missed")
    ap.add_argument("--clock", choices=("wall", "virtual"), default=None,
                    help="virtual: each rank's clock as the emulated cluster's (the lessons' --clock)")
    ap.add_argument("--link", default=None, help="the link messages cross (the lessons' --link)")
    ap.add_argument("--device", default=None, help="virtual clock: price ops on this device (the lessons')")
    args = ap.parse_args(argv)
    use_clock(args)  # into the environment: the mpirun ranks inherit it
    if args.quick:
        args.stages, args.microbatches, args.transport = [2], [4], "threads"
        args.batch, args.seq, args.layers, args.width, args.steps, args.repeats = 8, 8, 2, 16, 3, 2
    if under_mpi():
        return max(run(bench, args=args))
    if args.transport == "threads":
        return max(max(run(bench, ranks=p, transport="threads", args=args)) for p in args.stages)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    rest = argv if argv is not None else sys.argv[1:]
    codes = [subprocess.call(["mpirun", "-n", str(p), sys.executable, os.path.abspath(__file__), *rest,
                              "--stages", *map(str, args.stages)], env=env) for p in args.stages]
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
