"""Enumerate candidate meshes for a model on N chips, predict each, rank, and say why the others lose.

Candidates: tp a divisor of the chips in one fast domain (and of the heads), pp a divisor of the
layers' count that leaves every stage a layer, dp the rest; ZeRO 0/1/3; checkpointing none /
selective / full; microbatch sizes 1, 2, 4; 1F1B (and interleaved with 2 or 4 chunks when pp > 1),
or the schedules asked for (`pipeline_schedules`: ZB-H1, ZB-V, DualPipe, ... by their formulas);
for a mixture of experts, expert parallelism ep (a power of two dividing dp and the experts).
Ranking: those that fit first, then the shortest predicted step (a tie: less memory). A loser's
reason: it does not fit (by how much), or the largest of its differences in time from the first --
bubble, exposed communication on one axis, or compute (recomputation, a fuller pipeline stage).
"""

from __future__ import annotations

from minidist.parallel.pipeline.schedule import ScheduleError
from minidist.plan import schedules
from minidist.plan.hardware import Hardware
from minidist.plan.mesh import DEFAULT, Candidate, Settings
from minidist.plan.model import ModelSpec
from minidist.plan.steptime import Prediction, predict

MAX_CHIPS = 1 << 20  # the search walks every divisor of the chips: a million is seconds, not hours
MAX_CHIPS_WHY = "larger than any cluster built; the search would not finish"


def check_request(chips, batch, top) -> None:
    """The planner's inputs, before any search: a ValueError naming the argument and its range."""
    for name, value, high in (("chips", chips, MAX_CHIPS), ("batch", batch, None), ("top", top, None)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"plan: {name} must be an integer >= 1, got {value!r}")
        if high is not None and value > high:
            raise ValueError(f"plan: {name}={value:,} is more than {high:,} ({MAX_CHIPS_WHY})")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def pipeline_schedules(names, pp: int, m: int, stages_max: int) -> list[tuple[str, int]]:
    """(schedule, chunks) pairs to try for pp stages and m microbatches: 1F1B (plain and interleaved
    with 2 or 4 chunks) by default, else the `names` asked for (`minidist.plan.schedules`), each where
    it can run -- a V schedule has two chunks per stage, DualPipe needs pp even, the runtime's own
    rule (too few microbatches) where it has a builder."""
    if pp == 1:
        return [("1f1b", 1)]
    if names is None:
        return [("1f1b", 1)] + [("interleaved", v) for v in (2, 4) if m % pp == 0 and v * pp <= stages_max]
    out = []
    for name in names:
        sched = schedules.get(name)
        chunk_options = [sched.chunks] if sched.chunks else [2, 4] if sched.name == "interleaved" else [1]
        for v in chunk_options:
            if v * pp > stages_max or (sched.name == "dualpipe" and pp % 2):
                continue
            try:
                schedules.build(sched.name, pp, m, v)
            except ScheduleError:
                continue
            out.append((sched.name, v))
    return out


def candidates(model: ModelSpec, chips: int, batch: int, hw: Hardware, zero=(0, 1, 3),
               checkpoints=("none", "selective", "full"), microbatch_sizes=(1, 2, 4),
               schedule_names=None) -> list[Candidate]:
    """Every mesh to try (see the module docstring); `schedule_names`: the pipeline schedules to try
    (default 1F1B and interleaved 1F1B)."""
    out = []
    for tp in divisors(chips):
        if tp > hw.chips_per_domain or model.n_head % tp or (model.engine == "minidist" and model.vocab % tp):
            continue
        stages_max = model.n_layer + 2 if model.engine == "minidist" else model.n_layer  # a layer each
        for pp in divisors(chips // tp):
            if pp > stages_max:
                continue
            dp = chips // (tp * pp)
            for mb in microbatch_sizes:
                if batch % (dp * mb):
                    continue
                m = batch // (dp * mb)
                scheds = pipeline_schedules(schedule_names, pp, m, stages_max)
                eps = [e for e in (1, 2, 4, 8, 16, 32, 64) if model.experts > 1 and e <= dp
                       and dp % e == 0 and model.experts % e == 0] or [1]
                for sched, v in scheds:
                    for z in zero if dp > 1 else (0,):
                        for ck in checkpoints:
                            if model.engine == "minidist" and ck == "selective":
                                continue
                            out += [Candidate(dp=dp, tp=tp, pp=pp, ep=ep, zero=z, checkpoint=ck,
                                              microbatch_size=mb, schedule=sched, chunks=v) for ep in eps]
    return out


def reason(best: Prediction, other: Prediction, hbm: float) -> str:
    """Why `other` ranks below `best`, in a few words."""
    if not other.fits:
        return f"does not fit: {other.memory['total'] / 1e9:.1f} GB > {hbm / 1e9:.0f} GB"
    diffs = {"bubble": other.bubble - best.bubble, "compute": other.compute - best.compute}
    for ax, t in other.comm.items():
        diffs[f"{ax} comm"] = t - best.comm.get(ax, 0.0)
    what, d = max(diffs.items(), key=lambda kv: kv[1])
    if d <= 1e-9 * best.step:
        more = other.memory["total"] - best.memory["total"]
        share = more / max(best.memory["total"], 1)
        return "same predicted step" + (f", {share:+.0%} memory" if more else "")
    why = ""
    if what == "compute" and other.cand.checkpoint != best.cand.checkpoint:
        why = f" (recomputation: {other.cand.checkpoint} vs {best.cand.checkpoint})"
    elif what == "compute" and other.cand.pp != best.cand.pp:
        why = " (the busiest stage holds more layers)"
    return f"+{d:.3g} s {what}{why}"


def order(p: Prediction) -> tuple:
    """Fitting first, then the shortest step, then (a tie) the least memory."""
    return (not p.fits, p.step, p.memory["total"])


def plan(model: ModelSpec, chips: int, batch: int, hw: Hardware, settings: Settings = DEFAULT, top: int = 5,
         cands=None, simulate: int | None = None) -> list[Prediction]:
    """Predictions for every candidate, fitting ones first, fastest first (each with `.reason`).
    All are ranked with the bubble formula first; the first `simulate` (default max(2·top, 10)) are
    then predicted again with their schedule simulated, and re-ranked."""
    check_request(chips, batch, top)
    cands = cands if cands is not None else candidates(model, chips, batch, hw)
    quick = [predict(model, c, batch, hw, settings, simulate_schedule=False) for c in cands]
    quick.sort(key=order)
    # simulate the real schedule for the front of the list (the formula ranks the rest)
    n = max(top * 2, 10) if simulate is None else simulate
    head = [predict(model, p.cand, batch, hw, settings) for p in quick[:n]]
    ranked = sorted(head, key=order) + quick[len(head):]
    for p in ranked:
        p.reason = "best" if p is ranked[0] else reason(ranked[0], p, hw.hbm_bytes)
    if not ranked[0].fits:
        ranked[0].reason = reason(ranked[0], ranked[0], hw.hbm_bytes) + " (nothing fits)"
    return ranked


def compare_published(run, top: int = 5, cands=None, simulate: int | None = None) -> dict:
    """Ask the planner for the best mesh of a published run and compare with the one the paper used.

    Returns {"rank" (1-based, of the published mesh), "best", "published" (Predictions), "agrees"
    (rank <= top), "explanation", "same_shape_rank"}: when the planner disagrees it says what its best
    changes (mesh shape, ZeRO, checkpointing, microbatch size, schedule), the largest part of the time gap,
    and where the published *shape* (dp, tp, pp) ranks with the best's other settings -- telling a
    different shape apart from a technique the paper did not have or did not use.
    """
    mesh = dict(run.mesh)
    pub = Candidate(microbatch_size=mesh.pop("microbatch_size"), **mesh)
    if cands is None:
        cands = candidates(run.model, run.chips, run.global_batch, run.hardware)
    cands = list(cands)
    if pub not in cands:
        cands.append(pub)
    ranked = plan(run.model, run.chips, run.global_batch, run.hardware, top=top, cands=cands,
                  simulate=simulate)
    n = max(top * 2, 10) if simulate is None else simulate
    rank = next(i for i, p in enumerate(ranked) if p.cand == pub) + 1
    best, published = ranked[0], ranked[rank - 1]
    if rank > n:  # ranked by the bubble formula only: simulate its schedule too
        published = predict(run.model, pub, run.global_batch, run.hardware)
    fields = ("dp", "tp", "pp", "zero", "checkpoint", "microbatch_size", "schedule", "chunks")
    changes = [f"{f} {getattr(pub, f)} -> {getattr(best.cand, f)}" for f in fields
               if getattr(pub, f) != getattr(best.cand, f)]
    shape = best.cand.replace(dp=pub.dp, tp=pub.tp, pp=pub.pp)
    same_shape = next((i + 1 for i, p in enumerate(ranked) if p.cand == shape), None)
    out = {"rank": rank, "best": best, "published": published, "agrees": rank <= top,
           "same_shape_rank": same_shape, "changes": changes}
    if rank <= top:
        out["explanation"] = f"the published mesh ranks #{rank} of {len(ranked)}"
    else:
        gap = reason(best, published, run.hardware.hbm_bytes)
        where = (f"; the published shape dp{pub.dp} tp{pub.tp} pp{pub.pp} with the best's other settings "
                 f"ranks #{same_shape}") if same_shape else ""
        out["explanation"] = (f"the published mesh ranks #{rank} of {len(ranked)}, predicted "
                              f"{published.step / best.step:.2f}x the best's step; the best changes "
                              f"{', '.join(changes)}; largest part of the gap: {gap}{where}")
    return out
