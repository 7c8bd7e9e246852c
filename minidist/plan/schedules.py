"""What the planner knows of each pipeline schedule: its bubble and peak activations as formulas.

One `ScheduleModel` per schedule name, in `SCHEDULES`. Times are of ONE microbatch through ONE
stage: F forward, B the input-gradient half of the backward, W the weight-gradient half;
`bubble(p, m, F, B, W)` is what a stage idles in a step (fraction: bubble / (bubble + m(F+B+W))):

=============  ======================================  =======================  ===========
schedule       bubble (seconds a stage idles)          peak activations (M_B)   parameters
=============  ======================================  =======================  ===========
gpipe          (p-1)(F+B+W)                            m                        1x
1f1b           (p-1)(F+B+W)                            min(m, p)                1x
interleaved    (p-1)(F+B+W) / v                        see `interleaved_peak`   1x
zb_h1          (p-1)max(F+B-W, F, B)                   min(m, p)                1x
zb_h2          (p-1)(F+B-2W), at least 0               min(m, 2p-1)             1x
zb_v           (p-1)(F+B-2W), at least 0  (*)          min(m, p)                1x
dualpipe       (p/2-1)(F+B-W)  (**)                    min(m, p+1)              2x
dualpipe_v     (p-1)(F+B-W)/2: 2p half-stage chunks    min(m, p + 1/2)          1x
=============  ======================================  =======================  ===========

(*), (**), the sources: chapter 11; why minidist's DualPipe idles (PP/2-1)(F+B-W): chapter 5.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from minidist.parallel.pipeline.catalog import make_schedule
from minidist.parallel.pipeline.schedule import ScheduleError
from minidist.plan.shared_cores import run_on_cores


@dataclass(frozen=True)
class ScheduleModel:
    name: str                  # what Candidate.schedule, make_schedule and --schedule say
    title: str
    bubble: Callable           # (p, m, F, B, W, v) -> seconds a stage idles per step
    peak: Callable             # (p, m, v) -> most microbatches' activations (M_B) the fullest stage holds
    params: float = 1.0        # parameter copies per device relative to 1F1B on the same devices
    split: bool = False        # runs each backward as B then W
    chunks: int | None = None  # model chunks per stage it always uses (None: the candidate's)
    approximate: str = ""      # what its formula leaves out, if it is not the paper's exact one
    per_stage: Callable | None = None  # (p, m, v, s) -> stage s's peak, where the paper gives one
    pending: Callable | None = None    # (p, m, v, s) -> stage s's most microbatches from B to W (M_W)

    def stage_peak(self, p: int, m: int, v: int, s: int) -> float | None:
        """Stage s's peak activations (M_B): the per-stage formula, or for stage 0 (the fullest) the
        schedule's peak; None where the formula says nothing about that stage."""
        if self.per_stage is not None:
            return self.per_stage(p, m, v, s)
        return self.peak(p, m, v) if s == 0 else None

    def stage_pending(self, p: int, m: int, v: int, s: int) -> int | None:
        """Stage s's M_W in microbatches (those whose B ran and whose W has not), where known."""
        return None if self.pending is None else self.pending(p, m, v, s)

    def bubble_fraction(self, p: int, m: int, F: float = 1.0, B: float = 1.0, W: float = 1.0,
                        v: int = 1) -> float:
        """The idle share of a stage's step: bubble / (bubble + m(F + B + W))."""
        idle = self.bubble(p, m, F, B, W, v) if p > 1 else 0.0
        return idle / (idle + m * (F + B + W))


def interleaved_peak(p: int, m: int, v: int, s: int = 0) -> float:
    """Megatron-LM's interleaved 1F1B on stage s: 2(p-s-1) + (v-1)p warm-up forwards of one chunk
    each (all m·v when m = p), plus the steady state's first forward; a chunk holds 1/v of M_B."""
    if m == p:
        return m
    return min(m * v, 2 * (p - s - 1) + (v - 1) * p + 1) / v


def _one_f_one_b_stage(p, m, v, s):
    """1F1B (and ZB-H1, which keeps its in-flight limit): stage s holds min(m, p - s)."""
    return min(m, p - s)


def _dualpipe(p, m, F, B, W, v):
    """DeepSeek's (p/2-1)(F&B + B' - 3W), B' = B + W the whole backward, at minidist's F&B = F + W."""
    full = B + W
    return max(0.0, (p / 2 - 1) * ((F + W) + full - 3 * W))


SCHEDULES = {s.name: s for s in (
    ScheduleModel("gpipe", "GPipe", lambda p, m, F, B, W, v: (p - 1) * (F + B + W), lambda p, m, v: m,
                  per_stage=lambda p, m, v, s: m),
    ScheduleModel("1f1b", "1F1B", lambda p, m, F, B, W, v: (p - 1) * (F + B + W),
                  lambda p, m, v: min(m, p), per_stage=_one_f_one_b_stage),
    ScheduleModel("interleaved", "interleaved 1F1B", lambda p, m, F, B, W, v: (p - 1) * (F + B + W) / v,
                  interleaved_peak, per_stage=interleaved_peak),
    ScheduleModel("zb_h1", "ZB-H1", lambda p, m, F, B, W, v: (p - 1) * max(F + B - W, F, B),
                  lambda p, m, v: min(m, p), split=True, per_stage=_one_f_one_b_stage,
                  pending=lambda p, m, v, s: min(m, s + 1)),  # W put off by s: s + 1 from B to W
    ScheduleModel("zb_h2", "ZB-H2", lambda p, m, F, B, W, v: max(0.0, (p - 1) * (F + B - 2 * W)),
                  lambda p, m, v: min(m, 2 * p - 1), split=True),
    ScheduleModel("zb_v", "ZB-V", lambda p, m, F, B, W, v: max(0.0, (p - 1) * (F + B - 2 * W)),
                  lambda p, m, v: min(m, p), split=True, chunks=2,
                  approximate="ZB-H2's bound away from F = B = W"),
    ScheduleModel("dualpipe", "DualPipe", _dualpipe, lambda p, m, v: min(m, p + 1), params=2.0, split=True,
                  per_stage=lambda p, m, v, s: min(m, p + 1)),  # every rank: PP + 1 pieces
    ScheduleModel("dualpipe_v", "DualPipeV",
                  lambda p, m, F, B, W, v: _dualpipe(2 * p, m, F / 2, B / 2, W / 2, v),
                  lambda p, m, v: min(2 * m, 2 * p + 1) / 2, split=True, chunks=2,
                  per_stage=lambda p, m, v, s: min(2 * m, 2 * p + 1) / 2),
)}


def canonical(name: str) -> str:
    """'zb-h1' and 'zb_h1' name one schedule (the lesson's flags use hyphens): the registry's key."""
    return name.replace("-", "_")


def get(name: str) -> ScheduleModel:
    """The model of schedule `name`; a ValueError lists the names the planner knows."""
    try:
        return SCHEDULES[canonical(name)]
    except KeyError:
        raise ValueError(f"unknown pipeline schedule {name!r}; the planner knows "
                         f"{', '.join(SCHEDULES)}") from None


def textbook(p: int, m: int, v: int = 1) -> float:
    """The bubble every course quotes first: (p-1)/(v·m + p-1) (GPipe, 1F1B; v chunks interleaved)."""
    return (p - 1) / (v * m + p - 1)


def build(name: str, p: int, m: int, v: int = 1):
    """Schedule `name`'s instruction lists from the runtime (`make_schedule`), or None while the
    runtime has no builder for it (the planner then uses the formulas). A schedule that exists but
    cannot run these p, m (too few microbatches) raises its ScheduleError."""
    key = canonical(name)
    for spelling in dict.fromkeys((key, key.replace("_", "-"))):
        try:
            return make_schedule(spelling, p, m, v)
        except ScheduleError as e:
            if "unknown schedule" not in str(e):
                raise
    return None


def on_shared_cores(model: ScheduleModel, p: int, m: int, slowdown: float, F: float = 1.0, B: float = 1.0,
                    W: float = 1.0, v: int = 1) -> float:
    """The bubble when ranks share too few cores and each rank's work runs `slowdown` times slower
    (ranks / cores) but its waits do not -- a waiting rank's core runs the others' work -- the
    planner's rule (`steptime.predict`): idle / (idle + slowdown · m(F + B + W)). For 1F1B:
    (p-1) / (slowdown·m + p-1)."""
    idle = model.bubble(p, m, F, B, W, v) if p > 1 else 0.0
    return idle / (idle + max(1.0, slowdown) * m * (F + B + W))


def this_machine(name: str, p: int, m: int, ranks: int, cores: int, v: int = 1) -> tuple[float, str]:
    """(bubble, one line) the planner predicts for schedule `name` when `ranks` ranks (ranks / p
    pipelines side by side) share `cores` cores, F = B = W: what a lesson prints beside the textbook
    formula, so the two can be compared honestly on a crowded machine. Where the runtime builds the
    schedule it is run on the shared cores (`shared_cores.run_on_cores`: each rank that has work
    gets min(1, cores / ranks with work) of a core, a waiting rank none); else the formula with
    every rank's work s = ranks / cores times slower and its waits not (`on_shared_cores`)."""
    sched = get(name)
    lists = build(name, p, m, sched.chunks or v) if p > 1 else None
    if lists is None:
        s = max(1.0, ranks / max(cores, 1))
        value = on_shared_cores(sched, p, m, s, v=v)
        return value, (f"planner's bubble for this machine: {value:.3f} (the formula with every rank's work "
                       f"{s:g} = ranks/cores = {ranks}/{cores} times slower and its waits not)")
    chunks = sched.chunks or v
    run = run_on_cores(lists, cores, 1.0 / chunks, 2.0 / chunks, replicas=max(1, ranks // p))
    value = run["bubble"]
    return value, (f"planner's bubble for this machine: {value:.3f} ({ranks} ranks on {cores} cores, "
                   f"F = B = W: a rank with work gets min(1, {cores}/ranks with work) of a core, a waiting "
                   f"rank none; it leaves out the cores waiting ranks spin on and their wake-ups)")
