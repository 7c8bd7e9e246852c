"""Seconds of math for one microbatch through one pipeline stage: a chip's roofline, or this machine's
kernels.

Presets: matmul FLOPs / (peak · gemm_efficiency) + memory-bound ops (each saved activation moved ~3
times over HBM) + a fixed cost per op; backward = 2 x forward (+ a forward with full recomputation).
This machine (`hw.kernels`, from `python -m minidist.calibrate`): a sum over minidist's ops at the
rates calibrate measured for each, plus its measured Python (`kernel_time`, `python_time`).
"""

from __future__ import annotations

from minidist.plan.hardware import Hardware
from minidist.plan.mesh import Candidate, Settings, layer_activation, layer_kinds, stage_layers
from minidist.plan.model import ModelSpec
from minidist.plan.sharing import python_crowding

OPS_PER_BLOCK = 19    # minidist Block: functions run in forward (ln, linear, reshape, ...); backward as many
OPS_HEAD = 5          # Head + cross-entropy


def _stage_math(model: ModelSpec, cand: Candidate, hw: Hardware, stage: int, settings: Settings) -> tuple:
    """(forward, backward) seconds of math for one microbatch through one stage (all its chunks)."""
    kinds = layer_kinds(model)
    tokens = cand.microbatch_size * model.seq // cand.cp
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
    h, s, b = model.d_model, model.seq // cand.cp, cand.microbatch_size
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


def memory_bound_bytes(model: ModelSpec, cand: Candidate, stage: int, settings: Settings) -> float:
    """Bytes the memory-bound ops move for one microbatch: each saved activation ~3 times."""
    kinds = layer_kinds(model)
    plain = cand.replace(checkpoint="none")
    return 3.0 * sum(layer_activation(model, plain, kinds[i], i - 1, cand.microbatch_size, settings)
                     for i in stage_layers(model, cand)[stage])

