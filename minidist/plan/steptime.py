"""Predicted step time of a candidate mesh: compute, exposed communication per axis, pipeline bubble.

Per pipeline stage and microbatch (chunk):
  forward  = matmul FLOPs / (peak · gemm_efficiency) + memory-bound ops + its tensor/context/expert-
             parallel collectives (not overlapped: Megatron-LM's TP all-reduces sit between matmuls)
  backward = 2 x the forward's math (+ one more forward with full recomputation) + its collectives
Memory-bound ops (norms, GELU, softmax, dropout, residuals) move each saved activation about three
times (written in forward, read and its gradient written in backward): 3 · activation bytes / HBM
bandwidth. On this machine (`--hardware here`) every op also costs `op_overhead` (Python and
dispatch: calibrate's measured Python per block and for the embedding + head), a whole step costs
calibrate's `cold` times the sum of its ops (timed one at a time, in cache), MPI processes that
outnumber the CPUs lose the probe's share of their Python besides (`python_crowding`), and when the ranks
share too few cores every rank's work and messages run ranks / cores times slower, the bubble not
(`rank_slowdown`: processes get the free cores; thread ranks share one GIL, and once they outnumber
the CPUs their Python, kernels and messages take turns -- calibrate measures the cores they get).

The pipeline is then *simulated* (`minidist.parallel.pipeline.simulate.simulate`) on the candidate's real
schedule with those stage times and the point-to-point time of one activation, which gives the
makespan and the bubble. Data-parallel gradient traffic starts during the last microbatch's
backward (as minidist's 3D training and Megatron-LM's overlap do): only what does not fit under
that backward is exposed. Each axis runs on the link it maps to: tp (fastest, innermost ranks)
inside a node / ICI; dp inside the node while tp·dp fits there, else hierarchically (inside, then
across); pp across nodes once tp·dp fills one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from minidist.parallel.pipeline.runtime import make_schedule
from minidist.parallel.pipeline.simulate import simulate
from minidist.plan.hardware import Hardware, Link
from minidist.plan.mesh import (
    DEFAULT,
    Candidate,
    Settings,
    distinct_stages,
    layer_activation,
    layer_kinds,
    memory,
    stage_layers,
)
from minidist.plan.model import ModelSpec
from minidist.plan.traffic import Placement, all_reduce_rounds, collectives

OPS_PER_BLOCK = 19    # minidist Block: functions run in forward (ln, linear, reshape, ...); backward as many
OPS_HEAD = 5          # Head + cross-entropy
LINK_RANKS = 2        # thread ranks calibrate measures the threads link with (`allreduce_alpha_beta`)


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


@functools.lru_cache(maxsize=1024)
def _largest_divisor(n: int, cap: int) -> int:
    """The largest divisor of n that is at most cap (how many of an axis' ranks share a domain)."""
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def axis_link(hw: Hardware, cand: Candidate, axis: str) -> tuple[Link, int, Link | None, int]:
    """(inner link, ranks on it, outer link or None, ranks across) for a mesh axis."""
    dom = hw.chips_per_domain
    if axis == "tp":
        return (hw.intra, cand.tp, None, 1) if cand.tp <= dom else (hw.inter, cand.tp, None, 1)
    if axis in ("cp", "ep"):
        inner = cand.tp * (cand.cp if axis == "cp" else cand.ep)
        return (hw.intra if inner <= dom else hw.inter), (cand.cp if axis == "cp" else cand.ep), None, 1
    if axis == "dp":
        fits = dom // max(1, cand.tp)  # dp ranks of one tp coordinate inside a domain
        inside = _largest_divisor(cand.dp, max(1, fits))
        if inside >= cand.dp:
            return hw.intra, cand.dp, None, 1
        return hw.intra, inside, hw.inter, cand.dp // inside
    # pp: the outermost axis
    return (hw.intra if cand.tp * cand.dp * cand.pp <= dom else hw.inter), cand.pp, None, 1


def collective_time(hw: Hardware, cand: Candidate, c) -> float:
    """Seconds for one call of collective `c`: its algorithm's rounds x latency + bytes / bandwidth; a
    data-parallel axis split over two links reduces inside first, then sends 1/inside of the bytes
    across.

    MPI processes on this machine (`hw.crowd`). DDP's buckets (dp) go through the communication
    thread at the end of the backward, when every process is all-reducing: the link calibrate's probe
    measured with all the mesh's processes all-reducing at once (`background`), wall time, crowding
    included, not stretched again. Every other collective (tp, cp, ep, pp) is called between
    computations by its own group while the other processes compute: the link the probe measured
    for a group of that size alone, its rounds' work then taking turns with the rest of the mesh --
    stretched by rank_slowdown(mesh) / rank_slowdown(group). (A round all-reduced by a crowd of 8
    that does nothing else is far slower than a pair's alone: pricing a tp pair's rounds inside
    8 computing processes at the crowd's rate makes a 3D mesh too slow; chapter 11 has the numbers.)"""
    crowd = hw.crowd(cand.chips)
    stretch = 1.0
    if crowd is not None:
        p, outer, q = axis_size(cand, c.axis), None, 1
        if c.axis == "dp":
            link = crowd.link(algorithm(c) or "ring", background=True)
        else:
            group = hw.crowd(p) or crowd
            link = group.link(algorithm(c) or "ring", background=False)
            stretch = rank_slowdown(hw, cand.chips) / rank_slowdown(hw, group.ranks)
    else:
        link, p, outer, q = axis_link(hw, cand, c.axis)
    if c.axis == "pp":
        return stretch * (link.latency + c.sent / link.bandwidth)
    if outer is None or q == 1:
        return stretch * (rounds(c, p) * link.latency + c.sent / link.bandwidth)
    passes = 2 if algorithm(c) else 1  # reduce-scatter + all-gather, or one of them
    inside = passes * (p - 1) * link.latency + passes * (p - 1) / p * c.payload / link.bandwidth
    across = passes * (q - 1) * outer.latency + passes * (q - 1) / q * c.payload / p / outer.bandwidth
    return inside + across


def algorithm(c) -> str:
    """The all-reduce algorithm of collective `c` ("ring" for "ring_all_reduce"), or "" if it is not one."""
    return c.name[:-len("_all_reduce")] if c.name.endswith("_all_reduce") else ""


def rounds(c, p: int) -> int:
    """Message rounds of one call on p ranks: an all-reduce's per its algorithm
    (`minidist.plan.traffic.all_reduce_rounds`), one ring pass (p-1) for the others."""
    return all_reduce_rounds(algorithm(c), c.payload, p) if algorithm(c) else p - 1


def axis_size(cand: Candidate, axis: str) -> int:
    return {"tp": cand.tp, "dp": cand.dp, "pp": cand.pp, "cp": cand.cp, "ep": cand.ep}[axis]


def _stage_math(model: ModelSpec, cand: Candidate, hw: Hardware, stage: int, settings: Settings) -> tuple:
    """(forward, backward) seconds of math for one microbatch through one stage (all its chunks)."""
    kinds = layer_kinds(model)
    tokens = cand.microbatch * model.seq // cand.cp
    flops = 0.0
    ops = 0
    for i in stage_layers(model, cand)[stage]:
        if kinds[i] == "block":
            flops += model.layer_forward_flops(i - 1, tokens) / cand.tp
            ops += OPS_PER_BLOCK
        elif kinds[i] == "head":
            flops += model.head_forward_flops(tokens) / cand.tp
            ops += OPS_HEAD
    if hw.kernels is not None and model.engine == "minidist":
        fwd, bwd = kernel_time(model, cand, hw, stage)
        return fwd, bwd, flops
    act = memory_bound_bytes(model, cand, stage, settings)
    fwd = flops / (hw.peak_flops * hw.gemm_efficiency) + act / hw.hbm_bandwidth
    overhead = ops * hw.op_overhead
    bwd = 2 * fwd
    if cand.checkpoint == "full":
        bwd += fwd
    elif cand.checkpoint == "selective":  # recompute the attention core: 4·s·h FLOPs per token per layer
        core = sum(4.0 * tokens * model.seq * model.n_head * model.head_dim / cand.tp
                   for i in stage_layers(model, cand)[stage] if kinds[i] == "block")
        bwd += core / (hw.peak_flops * hw.gemm_efficiency)
    return fwd + overhead / 2, bwd + overhead / 2, flops


def kernel_time(model: ModelSpec, cand: Candidate, hw: Hardware, stage: int) -> tuple[float, float]:
    """(forward, backward) seconds of one microbatch through one stage of a minidist GPT on this
    machine: a sum over the ops of the work each does at the rate `minidist.plan.calibrate` measured for
    it (forward + backward together, split 1 : 2). Per block: the four linears (3 x 2·T·12h²/tp
    FLOPs), GELU on 4·T·h/tp elements, two layer norms on T·h, the attention's b·(H/tp)·s² scores
    (and its q·kᵀ, p·v matmuls at the linear rate), ~6 plain elementwise passes over T·h (residual
    adds, bias adds, head split/merge copies); the head's linear and cross-entropy on T·V/tp logits;
    every op's fixed cost; all of it x calibrate's `cold` (a whole step over the sum of its ops
    measured one at a time, in cache). One rank alone on a core; sharing the cores is `predict`'s
    business, but MPI processes' Python x `python_crowding` is this function's."""
    k = hw.kernels
    h, s, b = model.d_model, model.seq // cand.cp, cand.microbatch
    tokens, tp, d = b * s, cand.tp, model.head_dim
    lin_rate = k["linear_flops"]  # one BLAS thread per rank, as minidist runs its ranks
    kinds = layer_kinds(model)
    t, ops = 0.0, 0
    for i in stage_layers(model, cand)[stage]:
        if kinds[i] == "block":
            scores = b * (model.n_head // tp) * s * s
            t += 3 * 2 * tokens * 12 * h * h / tp / lin_rate + 3 * 2 * 2 * scores * d / lin_rate
            t += 4 * tokens * h / tp * k["gelu"] + 2 * tokens * h * k["layer_norm"]
            t += scores * k["attention_score"] + 6 * tokens * h * k["elementwise"]
            ops += OPS_PER_BLOCK
        elif kinds[i] == "head":
            t += 3 * 2 * tokens * h * model.vocab / tp / lin_rate + tokens * h * k["layer_norm"]
            t += tokens * model.vocab / tp * k["cross_entropy"]
            ops += OPS_HEAD
        else:
            t += 3 * tokens * h * k["elementwise"]
            ops += 3
    t += python_time(model, cand, hw, stage, ops) * python_crowding(hw, cand.chips)
    t *= k.get("cold", 1.0)  # ops in a step find cold caches (calibrate's whole step over its parts)
    fwd, bwd = t / 3, 2 * t / 3
    return fwd, bwd + (fwd if cand.checkpoint == "full" else 0.0)  # recomputation: one more forward


def python_time(model: ModelSpec, cand: Candidate, hw: Hardware, stage: int, ops: int) -> float:
    """Seconds of Python in one microbatch's forward + backward through one stage: calibrate's measured
    Python per block and for the embedding + head (half each), or, from an older calibration, `ops` x
    the fixed cost of one tiny op."""
    k = hw.kernels or {}
    if "python_block" not in k:
        return ops * hw.op_overhead
    kinds = [layer_kinds(model)[i] for i in stage_layers(model, cand)[stage]]
    blocks = kinds.count("block")
    return blocks * k["python_block"] + (len(kinds) - blocks) * k["python_ends"] / 2


def python_crowding(hw: Hardware, ranks: int) -> float:
    """How many times longer a rank's Python takes when `ranks` MPI processes outnumber this machine's
    CPUs, before the sharing itself (`rank_slowdown`): 1 + the probe's `python`. Processes that
    outnumber the cores take turns: one switched back in finds its caches holding another's arrays
    and interpreter state, and every wait for a partner is a switch -- costs that come per op, so a
    step of many thin ops loses more than one of few fat ones. 1 while each process has a CPU (no
    turns to take), for thread ranks (one process: `rank_slowdown` measures their sharing whole)
    and for presets."""
    crowd = hw.crowd(ranks)
    return 1.0 + crowd.python if crowd is not None and hw.cpus and ranks > hw.cpus else 1.0


def placement(hw: Hardware, ranks: int) -> Placement:
    """The transport `ranks` ranks run on here, whether they outnumber the CPUs, and (MPI here: one
    machine) that they share its memory: what the comm layer's "auto" all-reduce looks at. Presets:
    never crowded."""
    return Placement(hw.transport or "threads", bool(hw.cpus) and ranks > hw.cpus, hw.transport == "mpi")


def rank_slowdown(hw: Hardware, ranks: int) -> float:
    """How many times slower each of `ranks` ranks runs when they share this machine's cores: ranks /
    the cores' worth of work they get together (1 where every rank has its own chip).

    One rank alone: the share of a core calibrate found one rank gets (`hw.cores_one`: 1 on a quiet
    machine, less when other programs take turns on its core).
    MPI processes: the cores' worth calibrate's mpirun probe measured for that many processes doing
    minidist work at once (`hw.crowd`: once they outnumber the CPUs they take turns, and every switch
    costs cache), else the cores calibrate found free. Thread ranks share one GIL: only one runs
    Python at a time, and every time one releases it for a NumPy kernel another must be woken to
    take it. While the ranks fit on the cores that hand-off is quick; once they outnumber the cores,
    the rank woken for the GIL has to wait for a core that other ranks' kernels hold, so Python,
    kernels and messages end up taking turns, the more so the more ranks and the thinner their
    kernels: `hw.thread_cores(ranks)`, measured by calibrate for as many thread ranks as the CPUs,
    2 x and 4 x as many, a fixed batch split over them (8 ranks on a 2-vCPU machine: ~0.6-0.8 of a
    core, the hand-offs cost more than they save; 4 ranks more than that)."""
    crowd = hw.crowd(ranks)
    if crowd is not None:
        return max(1.0, ranks / crowd.cores)
    if ranks == 1 and hw.cores_one:  # one rank, thread or process: the share of a core it gets alone
        return max(1.0, 1.0 / hw.cores_one)
    if not hw.cores:
        return 1.0
    return max(1.0, ranks / (hw.thread_cores(ranks) if hw.gil else hw.cores))


def comm_slowdown(hw: Hardware, ranks: int) -> float:
    """How many times slower messages run than `collective_time` says. Thread ranks' messages (and
    MPI processes' without calibrate's probe) are priced at the threads link, which calibrate
    measured with `LINK_RANKS` ranks sharing the machine -- their sharing is in it already; with
    more ranks, the messages' Python takes its turn with the rest: rank_slowdown(ranks) /
    rank_slowdown(LINK_RANKS) (the same rule as a crowded MPI group's link, `collective_time`). MPI
    processes' probed links are priced in `collective_time` (1 here)."""
    if hw.crowd(ranks) is not None:
        return 1.0
    return max(1.0, rank_slowdown(hw, ranks) / rank_slowdown(hw, min(ranks, LINK_RANKS)))


def memory_bound_bytes(model: ModelSpec, cand: Candidate, stage: int, settings: Settings) -> float:
    """Bytes the memory-bound ops move for one microbatch: each saved activation ~3 times."""
    kinds = layer_kinds(model)
    plain = cand.replace(checkpoint="none")
    return 3.0 * sum(layer_activation(model, plain, kinds[i], i - 1, cand.microbatch, settings)
                     for i in stage_layers(model, cand)[stage])


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
    m, v = cand.microbatches(batch), cand.chunks
    mem = memory(model, cand, batch, settings)
    stages = _stages(model, cand, batch, hw, settings, m, cp_mode)
    # the busiest stage sets the pace of every stage in the schedule
    fwd = max(st.per_microbatch("forward", m) for st in stages)
    bwd = max(st.per_microbatch("backward", m) for st in stages)
    p2p = [c for c in stages[0].calls if c.axis == "pp"]
    p2p_time = collective_time(hw, cand, p2p[0]) if p2p else 0.0
    if cand.pp > 1 and simulate_schedule:
        sim = simulate(make_schedule(cand.schedule, cand.pp, m, v), fwd / v, bwd / v, p2p_time)
        makespan, bubble = sim.makespan, sim.bubble
    else:  # the textbook bubble (p-1)/(v·m+p-1): a quick estimate while searching
        makespan = (m + (cand.pp - 1) / v) * (fwd + bwd)
        bubble = (cand.pp - 1) / (v * m + cand.pp - 1)
    busy = m * (fwd + bwd)
    slow, comm_slow = rank_slowdown(hw, cand.chips), comm_slowdown(hw, cand.chips)
    if slow > 1:  # every rank's work (its math, Python and messages) runs slower; idle time (bubble,
        idle = makespan - busy  # waiting for sends) leaves its core to the others: not stretched
        busy = m * sum(max(st.per_microbatch(ph, m, slow, comm_slow) for st in stages)
                       for ph in ("forward", "backward"))
        bubble *= makespan / (busy + idle)
        makespan = busy + idle
    if hw.gil and hw.kernels is not None and model.engine == "minidist":
        # thread ranks: one GIL, so all ranks' Python runs one after another, however many cores
        ranks_per_stage = cand.dp * cand.tp * cand.cp
        gil = ranks_per_stage * m * sum(python_time(model, cand, hw, s, 0) for s in range(cand.pp)) * \
            hw.kernels.get("cold", 1.0)
        if gil > makespan:
            bubble *= makespan / gil
            makespan = gil
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
                      model_flops * recompute / cand.chips / step / 1e12)
