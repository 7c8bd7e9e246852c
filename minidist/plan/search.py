"""Enumerate candidate meshes for a model on N chips, predict each, rank, and say why the others lose.

Candidates: tp a divisor of the chips in one fast domain (and of the heads), pp a divisor of the
layers' count that leaves every stage a layer, dp the rest; ZeRO 0/1/3; checkpointing none /
selective / full; microbatch sizes 1, 2, 4; 1F1B (and interleaved with 2 chunks when pp > 1).
Ranking: among those that fit, the shortest predicted step; a loser's reason is the first of:
does not fit (by how much), a larger bubble, more exposed communication on an axis, more compute
(recomputation, smaller matmuls).
"""

from __future__ import annotations

from minidist.hardware import Hardware
from minidist.plan.mesh import DEFAULT, Candidate, Settings
from minidist.plan.model import ModelSpec
from minidist.plan.steptime import Prediction, predict


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(model: ModelSpec, chips: int, batch: int, hw: Hardware, zero=(0, 1, 3),
               checkpoints=("none", "selective", "full"), microbatches=(1, 2, 4)) -> list[Candidate]:
    out = []
    for tp in divisors(chips):
        if tp > hw.chips_per_domain or model.n_head % tp or model.vocab % tp:
            continue
        for pp in divisors(chips // tp):
            if pp > model.n_layer + 2:
                continue
            dp = chips // (tp * pp)
            for mb in microbatches:
                if batch % (dp * mb):
                    continue
                m = batch // (dp * mb)
                scheds = [("1f1b", 1)] + ([("interleaved", 2)] if pp > 1 and m % pp == 0
                                          and 2 * pp <= model.n_layer + 2 else [])
                for sched, v in scheds:
                    for z in zero if dp > 1 else (0,):
                        for ck in checkpoints:
                            if model.engine == "minidist" and ck == "selective":
                                continue
                            out.append(Candidate(dp=dp, tp=tp, pp=pp, zero=z, checkpoint=ck, microbatch=mb,
                                                 schedule=sched, chunks=v))
    return out


def reason(best: Prediction, other: Prediction, hbm: float) -> str:
    """Why `other` ranks below `best`, in a few words."""
    if not other.fits:
        return f"does not fit: {other.memory['total'] / 1e9:.1f} GB > {hbm / 1e9:.0f} GB"
    diffs = {"bubble": other.bubble - best.bubble, "compute": other.compute - best.compute}
    for ax, t in other.comm.items():
        diffs[f"{ax} comm"] = t - best.comm.get(ax, 0.0)
    what, d = max(diffs.items(), key=lambda kv: kv[1])
    return f"+{d:.3g} s {what}" + (" (recomputation)" if what == "compute" and other.cand.checkpoint != "none"
                                   else "")


def plan(model: ModelSpec, chips: int, batch: int, hw: Hardware, settings: Settings = DEFAULT, top: int = 5,
         cands=None) -> list[Prediction]:
    """Predictions for every candidate, fitting ones first, fastest first (each with `.reason`)."""
    cands = cands if cands is not None else candidates(model, chips, batch, hw)
    quick = [predict(model, c, batch, hw, settings, simulate_schedule=False) for c in cands]
    quick.sort(key=lambda p: (not p.fits, p.step))
    # simulate the real schedule for the front of the list (the formula ranks the rest)
    head = [predict(model, p.cand, batch, hw, settings) for p in quick[:max(top * 2, 10)]]
    ranked = sorted(head, key=lambda p: (not p.fits, p.step)) + quick[len(head):]
    for p in ranked:
        p.reason = "best" if p is ranked[0] else reason(ranked[0], p, hw.hbm_bytes)
    return ranked
