"""A candidate mesh, and what each of its ranks holds: memory by kind, per pipeline stage.

`Candidate(dp, tp, pp, cp, ep, zero, checkpoint, microbatch_size, schedule, chunks)` is one way to run a
model on dp·tp·pp·cp chips (ep experts-parallel ranks live inside dp, as in Megatron/DeepSpeed-MoE).
Rank order is minidist's (`minidist.comm.Mesh`): tensor fastest, then data, pipeline outermost.

`memory(model, cand, batch, settings)` returns per-device bytes of the fullest stage by kind:
params, grads, optimizer, activations, buffers. For the "minidist" engine every number is what
`minidist.nn.footprint.MemoryAccountant` reports for that rank (tests/plan/test_plan.py runs it and compares):
the layer list is minidist's (Embed, blocks, Head) cut by `partition_uniform`, tensor-parallel
shards are `TPGPT`'s, ZeRO shards follow DDP's gradient buckets (`build_buckets`, `Bucket.shard`),
and activations are those the ops save, times the microbatches a stage holds at its peak
(`minidist.parallel.pipeline.simulate.peak_activations` of the real schedule).
"""

from __future__ import annotations

import functools
import inspect
import types
from dataclasses import dataclass, replace

import numpy as np

from minidist.comm import split_sizes
from minidist.parallel.data.ddp import DistributedDataParallel, build_buckets
from minidist.parallel.pipeline.schedule import Backward, BackwardInput, Forward
from minidist.parallel.pipeline.simulate import peak_activations
from minidist.plan import schedules
from minidist.plan.layout import (  # noqa: F401 - re-exported: mesh's callers cut layers too
    _chunk_layers,
    _stage_layers,
    chunk_layers,
    layer_kinds,
    stage_layers,
)
from minidist.plan.model import (
    ModelSpec,
    minidist_block_elements,
    minidist_embed_elements,
    minidist_head_elements,
)

KINDS = ("params", "grads", "optimizer", "activations", "buffers")
# the gradient bucket capacity minidist's DDP (and ZeRO 1-2) use by default, read from DDP itself
DDP_BUCKET_BYTES = inspect.signature(DistributedDataParallel.__init__).parameters["bucket_bytes"].default


@dataclass(frozen=True)
class Candidate:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0                 # 0 = plain data parallel; 1, 2, 3 = ZeRO stages
    checkpoint: str = "none"      # "none", "selective", "full"
    microbatch_size: int = 1      # sequences per microbatch on one replica (the count is `microbatches`)
    schedule: str = "1f1b"        # a name in `minidist.plan.schedules.SCHEDULES`: "1f1b", "zb_h1", ...
    chunks: int = 1               # model chunks per stage (interleaved; the V schedules always use 2)

    def __post_init__(self):
        """The schedule by its registry name ('zb-h1' -> 'zb_h1'; an unknown one is a ValueError listing
        the known); a V schedule's two chunks per stage filled in, any other count refused."""
        model = schedules.get(self.schedule)
        object.__setattr__(self, "schedule", model.name)
        if model.chunks and self.chunks != model.chunks:
            if self.chunks != 1:
                raise ValueError(f"Candidate: {model.name} runs {model.chunks} chunks per stage, got "
                                 f"chunks={self.chunks}; leave chunks out or use chunks={model.chunks}")
            object.__setattr__(self, "chunks", model.chunks)

    @property
    def chips(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def microbatches(self, batch: int) -> int:
        """m, the lessons' --microbatches: microbatches per replica per step of a global `batch`."""
        return batch // (self.dp * self.microbatch_size)

    def replace(self, **kw) -> Candidate:
        return replace(self, **kw)

    def label(self) -> str:
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}"]
        parts += [f"cp{self.cp}"] if self.cp > 1 else []
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
        sched = self.schedule + (f"x{self.chunks}" if self.schedule == "interleaved" else "")
        return " ".join(parts) + f" z{self.zero} ckpt={self.checkpoint} mbsize={self.microbatch_size} {sched}"


@dataclass(frozen=True)
class Settings:
    """What the run stores: optimizer ("adamw"/"sgd"), and bytes per element of each state kind.
    Defaults per engine: megatron = bf16 params and grads + fp32 master, m, v (2 + 2 + 12, the ZeRO
    paper's mixed-precision accounting); minidist = everything in the model's dtype, AdamW m and v."""
    optimizer: str = "adamw"
    param_bytes: int | None = None
    grad_bytes: int | None = None
    opt_bytes: int | None = None
    sequence_parallel: bool = True

    def bytes_for(self, model: ModelSpec) -> tuple:
        if model.engine == "minidist":
            d = model.dtype_bytes
            k = {"adamw": 2 * d, "sgd": 0}[self.optimizer]
            k = k if self.opt_bytes is None else self.opt_bytes
            return self.param_bytes or d, self.grad_bytes or d, k
        k = {"adamw": 12, "sgd": 4}[self.optimizer]
        return self.param_bytes or 2, self.grad_bytes or 2, k if self.opt_bytes is None else self.opt_bytes


DEFAULT = Settings()


# -- the layer list and its parameters ---------------------------------------------------------------

def minidist_param_sizes(model: ModelSpec, kind: str, tp: int) -> list[int]:
    """Elements of each parameter of one minidist layer ("embed", "block", "head") on a tp rank, in
    `named_parameters` order (TPGPT's shards for tp > 1)."""
    h, v, s = model.d_model, model.vocab, model.seq
    if kind == "embed":
        return [v * h // tp, s * h]
    if kind == "head":
        return [h, h, h * v // tp]
    return [h, h, 3 * h * h // tp, 3 * h // tp, h * h // tp, h, h, h, 4 * h * h // tp, 4 * h // tp,
            4 * h * h // tp, h]


def stage_param_counts(model: ModelSpec, cand: Candidate, stage: int) -> tuple[int, list[int]]:
    """(elements this rank holds, per-parameter sizes in minidist order) for one pipeline stage."""
    kinds = layer_kinds(model)
    sizes = []
    for i in stage_layers(model, cand)[stage]:
        if model.engine == "minidist":
            sizes += minidist_param_sizes(model, kinds[i], cand.tp)
        elif kinds[i] == "embed":
            sizes.append(model.embed_params() // cand.tp)
        elif kinds[i] == "head":
            sizes.append(model.head_params() // cand.tp)
        else:
            layer = i - 1
            n = model.layer_params(layer)
            if model.is_moe(layer):  # experts split over ep, everything split over tp
                expert = model.experts * model.mlp_params()
                n = (n - expert) + expert // cand.ep
            sizes.append(n // cand.tp)
    return sum(sizes), sizes


def minidist_buckets(model: ModelSpec, cand: Candidate, stage: int, itemsize: int) -> list[tuple[int, str]]:
    """(elements, layer kind) of each gradient bucket minidist makes for this stage: DDP / ZeRO 1-2 cut
    the parameters in reverse order into buckets of DDP_BUCKET_BYTES (`build_buckets`); ZeRO-3 makes
    one bucket per unit (top-level layer), last layer first, so a unit is gathered as one."""
    kinds = layer_kinds(model)
    layers = stage_layers(model, cand)[stage]
    if cand.zero >= 3:
        return [(sum(minidist_param_sizes(model, kinds[i], cand.tp)), kinds[i]) for i in reversed(layers)]
    sizes = [n for i in layers for n in minidist_param_sizes(model, kinds[i], cand.tp)]
    fake = [types.SimpleNamespace(size=n, dtype=np.dtype(f"f{itemsize}")) for n in sizes]
    return [(b.numel, "mixed") for b in build_buckets(fake[::-1], DDP_BUCKET_BYTES)]


def zero_shard(model: ModelSpec, cand: Candidate, stage: int, itemsize: int) -> int:
    """Elements rank 0 (the largest share) owns under ZeRO: its `Bucket.shard` (np.array_split part)
    of every bucket."""
    return sum(split_sizes(n, cand.dp)[0] for n, _ in minidist_buckets(model, cand, stage, itemsize))


def distinct_stages(model: ModelSpec, cand: Candidate, m: int) -> list[int]:
    """One stage of each kind: stages holding the same kinds of layers (and the same neighbours'
    roles) hold, send and compute the same, so the planner looks at the first of each kind only."""
    seen, out = set(), []
    kinds = layer_kinds(model)
    for s, layers in enumerate(stage_layers(model, cand)):
        key = (tuple(kinds[i] for i in layers), s == 0, s == cand.pp - 1,
               in_flight(cand, m)[s])
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


# -- activations ---------------------------------------------------------------------------------

def in_flight(cand: Candidate, m: int) -> list[int]:
    """Microbatch-chunks each stage holds at its peak under the candidate's real schedule."""
    return _in_flight(cand.schedule, cand.pp, m, cand.chunks)


@functools.lru_cache(maxsize=256)
def _in_flight(schedule: str, pp: int, m: int, chunks: int) -> list[int]:
    """Per stage, from the runtime's instruction lists; a schedule the runtime cannot build yet gets
    its formula's peak (`minidist.plan.schedules`, in microbatch-chunks) on every stage."""
    if pp == 1:
        return [1 if schedule != "gpipe" else m]
    lists = schedules.build(schedule, pp, m, chunks)
    if lists is None:
        return [round(schedules.get(schedule).peak(pp, m, chunks) * chunks)] * pp
    return [peak_activations(ops) for ops in lists]


@functools.lru_cache(maxsize=1024)
def _held_peak(schedule: str, pp: int, m: int, chunks: int, stage: int, chunk_bytes: tuple) -> float:
    """Most bytes one stage holds at once when its chunks save different amounts: walk its
    instruction list, + a chunk's bytes at each Forward, - at its Backward (`peak_activations`,
    weighted)."""
    lists = schedules.build(schedule, pp, m, chunks)
    if lists is None:  # no builder yet: the formula's peak of whole microbatches
        return schedules.get(schedule).peak(pp, m, chunks) * sum(chunk_bytes)
    held = peak = 0.0
    for instr in lists[stage]:
        if isinstance(instr, Forward):
            held += chunk_bytes[instr.chunk]
        elif isinstance(instr, (Backward, BackwardInput)):  # B frees the activations; W keeps less
            held -= chunk_bytes[instr.chunk]
        peak = max(peak, held)
    return peak


def layer_activation(model: ModelSpec, cand: Candidate, kind: str, layer: int, b: int, settings) -> float:
    """Bytes one layer saves for one microbatch of b sequences, on one rank."""
    s = model.seq // cand.cp
    if model.engine == "minidist":
        if kind == "embed":
            return model.dtype_bytes * minidist_embed_elements(b, s, cand.tp)
        if kind == "head":
            return model.dtype_bytes * minidist_head_elements(b, s, model.d_model, model.vocab, cand.tp)
        if cand.checkpoint == "full":
            return model.dtype_bytes * b * s * model.d_model  # the checkpointed block keeps its input
        parts = minidist_block_elements(b, s, model.d_model, model.n_head, cand.tp)
        return model.dtype_bytes * sum(parts.values())
    if kind == "embed":
        return 0
    if kind == "head":  # fp32 logits for the loss, vocabulary-split
        return 4.0 * b * s * model.vocab / cand.tp
    return model.layer_activation_bytes(layer, b, cand.tp, cand.cp, cand.checkpoint,
                                        settings.sequence_parallel)


def stage_activation_peak(model: ModelSpec, cand: Candidate, batch: int, stage: int, settings,
                          recompute: bool = True) -> float:
    """Peak activation bytes of one stage: each microbatch chunk in flight keeps its layers' saved
    arrays; with full recomputation, the backward of one block re-creates that block's activations
    on top. `recompute=False`: only what forwards save (what the pipeline runtime's accountant,
    `StepStats.peak_activation_bytes`, tracks: it watches forwards, not the recomputation)."""
    m = cand.microbatches(batch)
    held = in_flight(cand, m)[stage]
    kinds = layer_kinds(model)
    layers = stage_layers(model, cand)[stage]
    b = cand.microbatch_size
    per_chunk = tuple(sum(layer_activation(model, cand, kinds[i], i - 1, b, settings) for i in chunk)
                      for chunk in chunk_layers(model, cand)[stage])
    per_mb = sum(per_chunk) / cand.chunks
    if cand.checkpoint != "full" or not recompute or not any(kinds[i] == "block" for i in layers):
        if cand.chunks == 1:
            return held * per_mb
        return _held_peak(cand.schedule, cand.pp, m, cand.chunks, stage, per_chunk)
    # full recomputation: the other microbatches keep their blocks' inputs (and head); the one in
    # backward has already freed its head's arrays and re-creates one block's activations
    head = sum(layer_activation(model, cand, "head", 0, b, settings) for i in layers if kinds[i] == "head")
    block = layer_activation(model, cand.replace(checkpoint="none"), "block", 1, b, settings)
    return (held - 1) * per_mb + (per_mb - head) + max(head, block)


# -- memory --------------------------------------------------------------------------------------

def memory(model: ModelSpec, cand: Candidate, batch: int, settings: Settings = DEFAULT) -> dict:
    """Bytes per device by kind (and "total", and "stage": which stage is fullest)."""
    pb, gb, kb = settings.bytes_for(model)
    best = None
    for stage in distinct_stages(model, cand, cand.microbatches(batch)):
        n, sizes = stage_param_counts(model, cand, stage)
        shard = zero_shard(model, cand, stage, pb) if model.engine == "minidist" else -(-n // cand.dp)
        mem = {
            "params": pb * (shard if cand.zero >= 3 else n),
            "grads": gb * (shard if cand.zero >= 2 else n),
            "optimizer": kb * (shard if cand.zero >= 1 else n),
            "activations": stage_activation_peak(model, cand, batch, stage, settings),
            "buffers": 0.0,
        }
        copies = schedules.get(cand.schedule).params  # DualPipe: each device holds two stages' weights
        for kind in ("params", "grads", "optimizer"):  # (and their gradients and optimizer state)
            mem[kind] *= copies
        if model.engine != "minidist" and cand.zero >= 3 and cand.pp == 1:
            mem["buffers"] = 2.0 * pb * max(sizes)  # two layers gathered at once (current + prefetch)
        mem["total"] = sum(mem[k] for k in KINDS)
        mem["stage"] = stage
        if best is None or mem["total"] > best["total"]:
            best = mem
    return best
