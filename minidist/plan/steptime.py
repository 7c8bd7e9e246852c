"""Predicted step time of a candidate mesh: compute, exposed communication per axis, pipeline bubble.

Per pipeline stage and microbatch: forward = its math (matmul FLOPs at peak · gemm_efficiency, plus
memory-bound ops) + its tensor/context/expert-parallel collectives, not overlapped; backward = 2 x
the math (+ a forward with full recomputation) + its collectives. The pipeline is then *simulated*
(`minidist.parallel.pipeline.simulate.simulate`) on the candidate's real schedule with those stage
times, which gives the makespan and the bubble. Data-parallel gradient traffic starts during the last
microbatch's backward: only what does not fit under it is exposed. Each axis runs on the link it
maps to (tp innermost, pp outermost). On this machine the ranks' sharing of the cores stretches it.

Why each term is what it is, and how well it predicts, is chapter 11 (lessons/11-planning.md, "The
model of cost" and "Timing here"). The parts live one idea to a file: `minidist.plan.compute` (math
per microbatch and stage), `minidist.plan.links` (an axis' link, one collective's time),
`minidist.plan.sharing` (ranks sharing this machine's cores), `minidist.plan.schedules` (each
pipeline schedule's bubble and memory).
"""

from __future__ import annotations

from dataclasses import dataclass

from minidist.parallel.pipeline.simulate import simulate
from minidist.plan import schedules
from minidist.plan.compute import (  # noqa: F401 - re-exported: the step's parts, where they were
    OPS_HEAD,
    OPS_PER_BLOCK,
    _stage_math,
    kernel_time,
    memory_bound_bytes,
    python_time,
)
from minidist.plan.hardware import Hardware
from minidist.plan.links import algorithm, axis_link, axis_size, collective_time, rounds  # noqa: F401
from minidist.plan.mesh import (
    DEFAULT,
    Candidate,
    Settings,
    distinct_stages,
    layer_kinds,
    memory,
    stage_layers,
)
from minidist.plan.model import ModelSpec
from minidist.plan.sharing import (  # noqa: F401 - re-exported
    LINK_RANKS,
    comm_slowdown,
    placement,
    python_crowding,
    rank_slowdown,
)
from minidist.plan.traffic import collectives


@dataclass
class Prediction:
    cand: Candidate
    memory: dict
    fits: bool
    step: float                 # seconds
    compute: float              # seconds of math on the busiest stage (all microbatches)
    comm: dict                  # axis -> exposed seconds
    bubble: float               # seconds the busiest stage idles (simulated schedule)
    bubble_fraction: float
    mfu: float
    tokens_per_s: float
    tflops_per_chip: float      # hardware FLOPs (recomputation counted) per chip per second / 1e12
    reason: str = ""            # set by the search: why it ranks below the first
    microbatches: int = 0       # m: microbatches per replica per step (the lessons' --microbatches)
    bubble_why: str = ""        # why the bubble is not the textbook (p-1)/(m+p-1) ("" when it is)



@dataclass
class _Stage:
    """One pipeline stage's share of a step: math per microbatch, and collectives by axis and phase."""
    fwd: float
    bwd: float
    comm: dict      # axis -> {"forward", "backward", "step"} -> seconds per step
    calls: list

    def per_microbatch(self, phase: str, m: int, slow: float = 1.0, comm_slow: float = 1.0) -> float:
        """Math plus the tp/cp/ep collectives of one microbatch's `phase` (they are not overlapped);
        the math `slow` and the collectives `comm_slow` times slower (ranks sharing the cores)."""
        inline = sum(t[phase] for ax, t in self.comm.items() if ax in ("tp", "cp", "ep")) / max(1, m)
        return slow * (self.fwd if phase == "forward" else self.bwd) + comm_slow * inline

    def axis(self, ax: str, phases=("forward", "backward", "step")) -> float:
        return sum(self.comm.get(ax, {}).get(ph, 0.0) for ph in phases)


def _stages(model, cand, batch, hw, settings, m, cp_mode="allgather") -> list[_Stage]:
    out = []
    for s in distinct_stages(model, cand, m):
        fwd, bwd, _ = _stage_math(model, cand, hw, s, settings)
        calls = collectives(model, cand, batch, s, settings, where=placement(hw, cand.chips), cp_mode=cp_mode)
        comm: dict = {}
        for c in calls:
            comm.setdefault(c.axis, {"forward": 0.0, "backward": 0.0, "step": 0.0})
            comm[c.axis][c.phase] += c.count * collective_time(hw, cand, c)
        out.append(_Stage(fwd, bwd, comm, calls))
    return out


def _optimizer_time(model, cand, hw, settings, mem) -> float:
    """The update: read and write the state once (HBM bandwidth), or this machine's measured AdamW and
    the step's Python outside the model (per parameter tensor and once)."""
    if hw.kernels is not None and model.engine == "minidist":  # SGD: about a quarter of AdamW's work
        k = hw.kernels
        rate = k["adamw"] * (1.0 if settings.optimizer == "adamw" else 0.25)
        kinds = layer_kinds(model)  # parameter tensors: 12 per block, 2 in the embedding, 3 in the head
        tensors = max(sum({"block": 12, "embed": 2, "head": 3}[kinds[i]] for i in layers)
                      for layers in stage_layers(model, cand))
        python = (tensors * k.get("python_tensor", 0.0) + k.get("python_step", 0.0)) * \
            python_crowding(hw, cand.chips)
        return (mem["params"] / model.dtype_bytes * rate + python) * k.get("cold", 1.0)
    return 2.0 * sum(mem[k] for k in ("params", "grads", "optimizer")) / hw.hbm_bandwidth


def predict(model: ModelSpec, cand: Candidate, batch: int, hw: Hardware, settings: Settings = DEFAULT,
            simulate_schedule: bool = True, cp_mode: str = "allgather") -> Prediction:
    """Memory, fit, step time and its breakdown for one candidate (see the module docstring);
    ``cp_mode``: context-parallel attention's traffic ("allgather", "ring", "ulysses": traffic.py)."""
    m, sched = cand.microbatches(batch), schedules.get(cand.schedule)
    v = sched.chunks or cand.chunks
    mem = memory(model, cand, batch, settings)
    stages = _stages(model, cand, batch, hw, settings, m, cp_mode)
    # the busiest stage sets the pace of every stage in the schedule
    fwd = max(st.per_microbatch("forward", m) for st in stages)
    bwd = max(st.per_microbatch("backward", m) for st in stages)
    p2p = [c for c in stages[0].calls if c.axis == "pp"]
    p2p_time = collective_time(hw, cand, p2p[0]) if p2p else 0.0
    # a split backward: B (the input's gradient) and W (the weights'), the same matmul FLOPs each
    b_in, b_w = (bwd / 2, bwd / 2) if sched.split else (bwd, 0.0)
    lists = schedules.build(cand.schedule, cand.pp, m, v) if cand.pp > 1 and simulate_schedule else None
    if lists is not None:
        # minidist's runtime posts its sends in the background (isend): its sender never waits for the
        # receiver; Megatron's 1F1B waits for each send-receive pair
        sim = simulate(lists, fwd / v, bwd / v, p2p_time, input_time=b_in / v, weight_time=b_w / v,
                       buffered_sends=sched.split or model.engine == "minidist")
        makespan, bubble = sim.makespan, sim.bubble
    else:  # the schedule's formula (`minidist.plan.schedules`): a quick estimate while searching
        idle = sched.bubble(cand.pp, m, fwd, b_in, b_w, v) if cand.pp > 1 else 0.0
        makespan = m * (fwd + bwd) + idle
        bubble = idle / makespan
    why = [_why_formula(sched, cand.pp, m, v, fwd, b_in, b_w)] if cand.pp > 1 else []
    if lists is not None and abs(bubble - sched.bubble_fraction(cand.pp, m, fwd, b_in, b_w, v)) > 0.005:
        why.append(f"each send between stages takes {p2p_time * 1e3:.3g} ms (the link's alpha + bytes/beta), "
                   f"and the schedule simulated with them idles {bubble:.1%}")
    busy = m * (fwd + bwd)
    slow, comm_slow = rank_slowdown(hw, cand.chips), comm_slowdown(hw, cand.chips)
    if slow > 1:  # every rank's work (its math, Python and messages) runs slower; idle time (bubble,
        idle = makespan - busy  # waiting for sends) leaves its core to the others: not stretched
        busy = m * sum(max(st.per_microbatch(ph, m, slow, comm_slow) for st in stages)
                       for ph in ("forward", "backward"))
        bubble *= makespan / (busy + idle)
        makespan = busy + idle
        why.append(f"{cand.chips} ranks share this machine's cores: each rank's work runs {slow:.2g}x "
                   f"slower while its waits do not (a waiting rank's core runs the others' work), so the "
                   f"idle share falls to {bubble:.1%}")
    if hw.gil and hw.kernels is not None and model.engine == "minidist":
        # thread ranks: one GIL, so all ranks' Python runs one after another, however many cores
        ranks_per_stage = cand.dp * cand.tp * cand.cp
        gil = ranks_per_stage * m * sum(python_time(model, cand, hw, s, 0) for s in range(cand.pp)) * \
            hw.kernels.get("cold", 1.0)
        if gil > makespan:
            bubble *= makespan / gil
            makespan = gil
            why.append(f"thread ranks share one GIL: all {cand.chips} ranks' Python runs one after another "
                       f"and fills the waits, so the idle share falls to {bubble:.1%}")
    dp = comm_slow * max(st.axis("dp") for st in stages)
    # DP traffic starts in the last microbatch's backward; ZeRO-3's gathers hide under all of compute.
    # Not when the ranks share too few cores: copying and reducing is work that takes its turn with the rest
    hidden = 0.0 if slow > 1 else (bwd / v if cand.zero < 3 else busy)
    dp_exposed = max(0.0, dp - hidden)
    update = slow * _optimizer_time(model, cand, hw, settings, mem)  # every rank updates at the same moment
    step = makespan + dp_exposed + update
    comm = {ax: comm_slow * max(st.axis(ax, ("forward", "backward")) for st in stages)
            for ax in ("tp", "cp", "ep")}
    pp_wait = makespan - busy - bubble * makespan  # idle beyond the bubble: waiting for sends
    comm["pp"] = pp_wait if cand.pp > 1 and pp_wait > 1e-9 * makespan else 0.0
    comm["dp"] = dp_exposed
    comm = {k: t for k, t in comm.items() if t > 0 or k in ("tp", "dp", "pp")}
    tokens = batch * model.seq
    model_flops = model.model_flops_per_token() * tokens
    recompute = 4 / 3 if cand.checkpoint == "full" else 1.0  # one more forward of three passes
    compute = slow * m * max(st.fwd + st.bwd for st in stages)
    return Prediction(cand, mem, mem["total"] <= hw.hbm_bytes, step, compute, comm, bubble * makespan, bubble,
                      model_flops / (cand.chips * hw.peak_flops * step), tokens / step,
                      model_flops * recompute / cand.chips / step / 1e12, microbatches=m,
                      bubble_why=explain_bubble(cand.pp, m, v if sched.name == "interleaved" else 1, bubble,
                                                why))


def _why_formula(sched, p: int, m: int, v: int, F: float, B: float, W: float) -> str:
    """The schedule's own formula when it is not the textbook's, with the costs it was given."""
    got = sched.bubble_fraction(p, m, F, B, W, v)
    if sched.name in ("gpipe", "1f1b", "interleaved"):
        return ""
    costs = f"F {F * 1e3:.3g} ms, B {B * 1e3:.3g} ms, W {W * 1e3:.3g} ms per microbatch and stage"
    note = f", {sched.approximate}" if sched.approximate else ""
    return f"the schedule is {sched.title}, whose own formula gives {got:.1%} ({costs}{note})"


def explain_bubble(p: int, m: int, v: int, bubble: float, why: list) -> str:
    """'' when the predicted bubble is the textbook (p-1)/(v·m+p-1) (within half a point), else one line:
    the two values, the p, m (and v) the formula was given, what the formula leaves out, and what the
    model adds, in the order it applies them."""
    book = schedules.textbook(p, m, v)
    if p == 1 or abs(bubble - book) <= 0.005:
        return ""
    formula = f"(p-1)/({'v·' if v > 1 else ''}m+p-1) = {p - 1}/{v * m + p - 1} = {book:.1%}"
    shape = (f"p = {p} stages, m = {m} microbatch{'' if m == 1 else 'es'} per replica"
             + (f", v = {v} chunks per stage" if v > 1 else ""))
    reasons = "; ".join(w for w in why if w) or "rounding"
    return (f"bubble {bubble:.1%}, where the textbook {formula} for {shape} counts only the warm-up and "
            f"cool-down of stages that send for free, each on a core of its own. What differs here: "
            f"{reasons}")
