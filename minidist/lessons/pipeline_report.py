"""What the pipeline lesson prints from every rank's records: the measured timeline of the last
step, the bubble beside its formula and the simulator fed the op costs the run measured (on the
virtual clock judged PASS/FAIL; on the wall clock beside the planner's bubble for this machine and
where the ranks' time went), and the peak activation memory per stage beside the simulated
microbatches held."""

from __future__ import annotations

import os

import numpy as np

from minidist import trace
from minidist.comm import under_mpi
from minidist.parallel.pipeline.catalog import make_schedule, schedule_chunks
from minidist.parallel.pipeline.dualpipe import dualpipe_bubble_formula, dualpipe_v_bubble_formula
from minidist.parallel.pipeline.simulate import (
    bubble_formula,
    measured_costs,
    peak_activations,
    peak_pending_weights,
    simulate,
    timeline_events,
)
from minidist.parallel.pipeline.zb_v import zb_v_bubble_formula
from minidist.parallel.pipeline.zero_bubble import zb_h1_bubble_formula
from minidist.plan import estimates, schedules

BUSY = ("Forward", "Backward", "BackwardInput", "BackwardWeight")  # what counts as a stage's work


def idle_split(everyone, step: int) -> str:
    """Where step `step`'s rank time went, measured: the share of ranks x step time each rank spent
    in forward/backward, waiting to receive, and in the rest (all-reduce, optimizer, send waits) --
    what to hold against the planner's bubble, which counts a stage's receives alone as idle."""
    evs = [e for r in everyone for e in r["events"][step]]
    span = max(e["t1"] for e in evs) - min(e["t0"] for e in evs)
    total = len(everyone) * span
    busy = sum(e["t1"] - e["t0"] for e in evs if e["name"] in BUSY) / total
    recv = sum(e["t1"] - e["t0"] for e in evs if e["cat"] == "recv" and e["name"] not in BUSY) / total
    return (f"measured split of step {step}'s ranks x time: forward/backward {busy:.3f}, waiting to receive "
            f"{recv:.3f}, all-reduce/optimizer/sends {max(0.0, 1 - busy - recv):.3f}")


def simulated_bubble(everyone, lists, steps, comm_time: float = 0.0) -> float:
    """The simulator's bubble at the costs the run measured, median over ``steps``: each (dp, tp)
    pipeline's schedule simulated with every F, B, W at its own span's duration (``measured_costs``),
    each message ``comm_time``, sends in the background as the runtime's are; all pipelines together,
    as the measured bubble counts them."""
    pipes = {}
    for r in everyone:
        pipes.setdefault(r["coords"][1:], []).append(r)
    bubbles = []
    for s in steps:
        events = []
        for i, ranks in enumerate(pipes.values()):
            spans = [dict(e, rank=r["coords"][0]) for r in ranks for e in r["events"][s]]
            sim = simulate(lists, op_time=measured_costs(spans), comm_time=comm_time, buffered_sends=True)
            events += [dict(e, rank=(i, e["rank"])) for e in sim.events if e["name"] in BUSY]
        bubbles.append(trace.bubble_fraction(events))
    return float(np.median(bubbles))


def report(everyone, args, pp: int, m: int, comm_time: float = 0.0, other=None):
    """Timeline, bubble and memory tables from every rank's records (rank 0 only). Returns the
    measured bubble, the simulator's at the measured costs, and whether the virtual clock's checks
    passed (True on the wall clock, which judges none). ``other``: every rank's events of one step
    of 1F1B on the same stages (for ZB-H1's comparison), or None."""
    virtual = everyone[0]["virtual"]
    last = len(everyone[0]["events"]) - 1
    pipe0 = [r for r in everyone if r["coords"][1:] == (0, 0)]  # the pipeline of dp 0, tp 0
    events = [dict(e, rank=r["coords"][0], **({"cat": "compute"} if e["name"] == "OptimizerStep" else {}))
              for r in pipe0 for e in r["events"][last]]
    start = min(e["t0"] for e in events if e["name"] == "Forward")  # from the step's first forward on
    events = [dict(e, t0=max(e["t0"], start)) for e in events if e["t1"] > start]
    print(f"\nmeasured timeline of step {last}, pipeline dp 0 / tp 0 (F3 = forward of microbatch 3, "
          f"B = backward, W = weight\ngradients, . = waiting, O = optimizer step"
          + (", with the data-parallel all-reduce of gradients" if args.dp > 1 else "")
          + ("; virtual clock" if virtual else "") + "):")
    print(trace.ascii_timeline_from_events(timeline_events(events), width=args.width_chars, label="stage"))

    steps = range(1, last + 1) if last >= 1 else range(1)
    chunks = schedule_chunks(args.schedule, args.chunks)
    measured = trace.median_bubble([r["events"] for r in everyone], skip=1, names=BUSY)
    lists = make_schedule(args.schedule, pp, m, args.chunks)
    sim = simulated_bubble(everyone, lists, steps, comm_time)
    formula = bubble_formula(pp, m, args.chunks)
    step_s = float(np.median([max(r["times"][s] for r in everyone) for s in steps]))
    print(f"\nbubble (idle share of ranks x step time, forward/backward count as busy): "
          f"measured {measured:.3f} "
          f"(median of steps {steps[0]}..{steps[-1]}) vs formula (p-1)/({'v·' if args.chunks > 1 else ''}"
          f"m+p-1) = {pp - 1}/"
          f"{args.chunks * m + pp - 1} = {formula:.3f}"
          + (f" (v = {args.chunks} chunks: 1F1B's would be {bubble_formula(pp, m):.3f})"
             if args.chunks > 1 else "")
          + f"; step time {step_s * 1e3:.0f} ms" + (" (virtual)" if virtual else ""))
    print(f"simulator at the op costs this run measured (each F, B, W its own span's time): {sim:.3f}")
    formulas(args.schedule, pp, m)
    ok = True
    if virtual:
        ok = checks(args.schedule, measured, formula, sim, other, everyone[0]["device"],
                    spread(everyone, steps))
        wall = float(np.median([max(r["wall"][s] for r in everyone) for s in steps]))
        print(f"wall clock: step time {wall * 1e3:.0f} ms here ({len(everyone)} ranks on "
              f"{os.cpu_count() or 1} cores)")
    else:
        print(schedules.this_machine(args.schedule, pp, m, len(everyone), os.cpu_count() or 1, chunks)[1])
        print(idle_split(everyone, last))
        print(estimates.predicted_vs_measured(
            "step time on this machine's calibrated constants (the planner, chapter 11)",
            estimates.step_prediction(args.layers, args.width, 4, 256, args.seq, args.batch, dp=args.dp,
                                      pp=pp, tp=args.tp, microbatches=m, schedule=args.schedule,
                                      chunks=chunks, dtype_bytes=np.dtype(args.dtype).itemsize,
                                      transport="mpi" if under_mpi() else "threads"), step_s))
        cores = os.cpu_count() or 1
        if len(everyone) > cores:
            print(f"(here {len(everyone)} ranks share {cores} cores, so a rank also waits for a free core; "
                  f"--clock virtual times the run as a cluster of {len(everyone)} devices would)")
    return measured, sim, ok


def own_formula(schedule: str, pp: int, m: int, chunks: int = 1) -> tuple[str, float]:
    """The chosen schedule's own bubble formula (at F = B = W for the split ones): its text, its value."""
    if schedule in ("zb-h1", "zb-h2"):
        return "(p-1)/(3m+p-1)", zb_h1_bubble_formula(pp, m)
    if schedule == "zb-v":
        return "(p-1)/(6m+p-1)", zb_v_bubble_formula(pp, m)
    if schedule == "dualpipe-v":
        return "DualPipeV's (p-1)(F&B+B-3W)", dualpipe_v_bubble_formula(pp, m)
    if schedule == "dualpipe":
        return "DualPipe's (p/2-1)(F&B+B-3W)", dualpipe_bubble_formula(pp, m)
    return ("(p-1)/(v·m+p-1)" if chunks > 1 else "(p-1)/(m+p-1)"), bubble_formula(pp, m, chunks)


SLACK = 0.03  # how far a bubble on the virtual clock may be from its formula or simulator


def spread(everyone, steps) -> tuple[float, float]:
    """How far the formula's premise (every op alike) is from the run: one forward's variation (the
    median over ranks of stdev / mean) and the busiest stage's compute over the mean stage's, - 1."""
    cvs, load = [], {}
    for r in everyone:
        f = [e["t1"] - e["t0"] for s in steps for e in r["events"][s] if e["name"] == "Forward"]
        if len(f) > 1 and np.mean(f) > 0:
            cvs.append(float(np.std(f) / np.mean(f)))
        busy = sum(e["t1"] - e["t0"] for s in steps for e in r["events"][s] if e["name"] in BUSY)
        load.setdefault(r["coords"][0], []).append(busy)
    stage = [float(np.mean(v)) for v in load.values()]
    return (float(np.median(cvs)) if cvs else 0.0), max(stage) / max(np.mean(stage), 1e-30) - 1


EQUAL = 0.10  # stages within 10% of each other's compute: the formula's equal stages


def checks(schedule: str, measured: float, formula: float, sim: float, other, exact: bool,
           noise: tuple[float, float]) -> bool:
    """The virtual clock's PASS/FAIL lines. 1F1B's bubble against (p-1)/(m+p-1) when the run is what
    the formula assumes: a device model (each op costs what its shapes say) and stages within 10%;
    otherwise, as every other schedule, against its simulator at the measured costs. ZB-H1's below
    1F1B's."""
    name = schedule.upper() if schedule.startswith("zb") else schedule
    jitter, uneven = noise
    if schedule == "1f1b" and exact and uneven <= EQUAL:
        lines = [(f"1F1B's bubble {measured:.3f} within {SLACK} of (p-1)/(m+p-1) = {formula:.3f}",
                  abs(measured - formula) <= SLACK)]
    else:
        lines = [(f"{name}'s bubble {measured:.3f} within {SLACK} of its simulator's {sim:.3f}",
                  abs(measured - sim) <= SLACK)]
        if schedule == "1f1b":
            why = (f"the busiest stage computes {uneven:.0%} more than the mean (the cut: --partition, "
                   "--layers)" if uneven > EQUAL else "")
            why = why or (f"in CPU time one forward's cost varies {jitter:.0%} here (--device NAME prices "
                          "each op by its shapes)")
            print(f"(the formula assumes equal stages of equal ops; {why}: judged by the simulator)")
    if schedule == "zb-h1" and other is not None:
        base = trace.bubble_fraction([dict(e, rank=i) for i, evs in enumerate(other) for e in evs
                                      if e["name"] in BUSY])
        lines.append((f"ZB-H1's bubble {measured:.3f} below 1F1B's {base:.3f} (one 1F1B step on the "
                      "same stages, after training)", measured < base))
    for text, passed in lines:
        print(f"{text}  {'PASS' if passed else 'FAIL'}")
    return all(passed for _, passed in lines)


def formulas(schedule: str, pp: int, m: int) -> None:
    """The split and V schedules' own formulas, at F = B = W."""
    if schedule in ("zb-h1", "zb-h2"):
        name = schedule.upper()
        print(f"{name}'s formula with F = B = W: (p-1)/(3m+p-1) = {pp - 1}/{3 * m + pp - 1} = "
              f"{zb_h1_bubble_formula(pp, m):.3f} (W = 'W' on the timeline fills what 1F1B leaves idle)")
    if schedule == "zb-v":
        print(f"ZB-V's bound with F = B = W (2p pieces, half-stage fill): (p-1)/(6m+p-1) = {pp - 1}/"
              f"{6 * m + pp - 1} = {zb_v_bubble_formula(pp, m):.3f}")
    if schedule == "dualpipe-v":
        print(f"DualPipeV's (p-1)(F&B + B - 3W) per 2p pieces, F&B = F + B (one op after the other): "
              f"{dualpipe_v_bubble_formula(pp, m):.3f}; its order, each receive before its own op, "
              f"reaches ZB-V's bound (p-1)/(6m+p-1) = {zb_v_bubble_formula(pp, m):.3f}")
    if schedule == "dualpipe":
        print(f"DualPipe's (p/2-1)(F&B + B - 3W) with F = B = W per piece, F&B = F + B: "
              f"{dualpipe_bubble_formula(pp, m):.3f}; its order, each receive before its own op: "
              f"(p/2-1)(F + B - W) = {dualpipe_bubble_formula(pp, m, overlap=1 / 3):.3f} (2x parameters: "
              f"each piece on ranks s and p-1-s, their gradients summed)")


def memory(everyone, args, pp: int, m: int) -> None:
    """Peak activation memory per stage, measured, beside the simulated microbatches held."""
    pipe0 = [r for r in everyone if r["coords"][1:] == (0, 0)]
    print("\npeak activation memory per stage (bytes saved for backward, measured; dp 0 / tp 0):")
    if schedule_chunks(args.schedule, args.chunks) > 1 or args.schedule == "dualpipe":  # several chunks
        print(f"{'stage':>5} {'bytes':>12} {'microbatch-chunks held':>23} {'simulated':>9}")
        sim = [peak_activations(ops) for ops in make_schedule(args.schedule, pp, m, args.chunks)]
        for r in sorted(pipe0, key=lambda r: r["coords"][0]):
            b, held = r["peak"][args.schedule]
            print(f"{r['coords'][0]:>5} {b:>12,} {held:>23} {sim[r['coords'][0]]:>9}")
        return
    if args.schedule in ("zb-h1", "zb-h2"):
        name = args.schedule.upper()
        print(f"(the paper's M_B: what a microbatch keeps from F to B; M_W, apart: what a put-off W keeps, "
              f"its layers' inputs and output gradients)\n{'stage':>5} {'1F1B bytes':>11} {'mbs':>4}   "
              f"{name + ' bytes':>11} {'M_B mbs':>7} {'sim':>3}   {'W-queue bytes':>13} {'M_W mbs':>7} "
              f"{'sim':>3}")
        sched = make_schedule(args.schedule, pp, m)
        fb, bw = [peak_activations(ops) for ops in sched], [peak_pending_weights(ops) for ops in sched]
        for r in sorted(pipe0, key=lambda r: r["coords"][0]):
            s, (ob, om), sp = r["coords"][0], r["peak"]["1f1b"], r["split"]
            zm = r["peak"][args.schedule][1]
            print(f"{s:>5} {ob:>11,} {om:>4}   {sp['peak_fb_bytes']:>11,} {zm:>7} {fb[s]:>3}   "
                  f"{sp['peak_weight_queue_bytes']:>13,} {sp['peak_pending_weights']:>7} {bw[s]:>3}")
        return
    print(f"{'stage':>5} {'GPipe bytes':>12} {'mbs held':>8} {'formula m':>9}   {'1F1B bytes':>11} "
          f"{'mbs held':>8} {'formula min(m,p-s)':>18}")
    sims = {name: [peak_activations(ops) for ops in make_schedule(name, pp, m)] for name in ("gpipe", "1f1b")}
    for r in sorted(pipe0, key=lambda r: r["coords"][0]):
        s = r["coords"][0]
        (gb, gm), (ob, om) = r["peak"]["gpipe"], r["peak"]["1f1b"]
        print(f"{s:>5} {gb:>12,} {gm:>8} {sims['gpipe'][s]:>9}   {ob:>11,} {om:>8} {sims['1f1b'][s]:>18}")
