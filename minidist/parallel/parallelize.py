"""``parallelize``: every technique applied to one GPT in the one documented order.

    par = parallelize(cfg, Mesh(comm, dp=2, pp=2, tp=2), microbatches=4, checkpoint="full",
                      precision="bf16", optimizer="adamw", lr=1e-3)
    for x, y in batches:                     # global batches, the same on every rank
        stats = par.step(x, y)               # this rank's rows and tokens, the schedule, the update

The order (torchtitan's ``parallelize_llama`` has the same shape), each step a few lines below:

1. **model transforms** -- the model is replaced or rewired: tensor / sequence parallelism (``TPGPT``,
   its init draws the serial GPT's numbers and keeps this rank's slices), experts (``moe_gpt``, ep
   carved from dp), context parallelism (``context_parallel``: attention becomes a ring, Ulysses'
   all-to-all or both), collective matmul (``use_collective_matmul``: the sequence-parallel
   collectives overlapped with the GEMMs), then FP8 training (``fp8_linear``: every Linear's products
   in FP8, a wrapper at the "autocast" position);
2. **the pipeline cut** -- ``PipelineStage`` keeps this rank's layers (pp = 1: all of them);
   without ZeRO every run is a stage, so one runtime (``run_schedule``) drives every mesh;
3. **activation checkpointing** -- per stage chunk (no segment crosses a stage boundary);
4. **mixed precision** -- ``MixedPrecision`` over the stage's layers: they compute in bf16 / fp16,
   fp32 master weights for this stage only, the last stage's loss times the loss scale;
5. **data parallelism** over the replica group (dp, or dp x cp with context parallelism): DDP on
   the stage, or ZeRO 1/2/3 on the model. Expert parameters are ``ignore``d by DDP (they differ
   across an ep group) and averaged over ``mesh.edp_cp`` at the step;
6. **the optimizer** -- SGD / AdamW by name, or ``OffloadedAdamW(where="host")`` with ``offload``,
   over what the others leave: the stage's parameters, the fp32 masters, or ZeRO's shards.

Every rank builds the same initial weights, so no broadcast is needed (DDP / ZeRO get
``broadcast_from=None``). Before anything is built the techniques chosen are checked pair by pair
against ``compose``'s matrix: a refused pair is a ``ValueError`` naming both -- that table is this
function's contract. ``check_3d`` holds the mesh errors (sizes, divisibility).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from minidist.accel.backend import to_host
from minidist.autograd import ops
from minidist.comm import all_reduce
from minidist.nn import GPT
from minidist.nn.module import Module, ModuleList
from minidist.nn.optim import make_optimizer
from minidist.parallel import compose
from minidist.parallel.context.model import MODES as CP_MODES
from minidist.parallel.context.model import context_parallel
from minidist.parallel.context.ring import shard_sequence
from minidist.parallel.data.ddp import DistributedDataParallel
from minidist.parallel.data.sharded import ShardedDataParallel
from minidist.parallel.data.zero import ZeRO
from minidist.parallel.experts.dispatch import expert_names, moe_gpt
from minidist.parallel.memory.fp8 import Fp8Recipe, fp8_linear
from minidist.parallel.memory.offload import OffloadedAdamW
from minidist.parallel.memory.precision import DynamicLossScaler, MixedPrecision
from minidist.parallel.memory.recompute import apply_checkpointing
from minidist.parallel.pipeline.runtime import (
    PipelineStage,
    StepStats,
    make_schedule,
    partition_balanced,
    partition_uniform,
    run_schedule,
    split_microbatches,
)
from minidist.parallel.tensor.collective_matmul import use_collective_matmul
from minidist.parallel.tensor.gpt import TPGPT


def check_3d(world_size: int, cfg, batch_size: int | None, dp: int, pp: int, tp: int, microbatches: int,
             chunks: int = 1, rank: int = 0, cp: int = 1, seq_len: int | None = None,
             checkpoint: str | None = None, ep: int = 1, moe: dict | None = None) -> None:
    """Every error a mesh run can have, raised before any communication, naming what would be right
    (``batch_size`` / ``seq_len`` None: not known yet, not checked)."""
    for name, v in (("dp", dp), ("pp", pp), ("cp", cp), ("tp", tp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"rank {rank}: mesh size {name}={v!r} must be a positive integer")
    if dp * pp * cp * tp != world_size:
        shown = f"dp={dp} x pp={pp} x " + (f"cp={cp} x " if cp > 1 else "") + f"tp={tp}"
        raise ValueError(f"rank {rank}: mesh {shown} = {dp * pp * cp * tp} ranks, but the "
                         f"world has {world_size}; choose sizes whose product is {world_size}")
    if cp > 1 and seq_len is not None and seq_len % (2 * cp):
        raise ValueError(f"rank {rank}: sequence length {seq_len} does not split into 2 x cp = {2 * cp} "
                         f"zig-zag chunks; use a length that is a multiple of {2 * cp}")
    if cp > 1 and cfg.dropout:
        raise ValueError(f"rank {rank}: context parallelism needs dropout=0 (got {cfg.dropout})")
    if ep > 1 and (moe is None or dp % ep or moe["n_experts"] % ep):
        raise ValueError(f"rank {rank}: ep={ep} needs an MoE model (moe=dict(n_experts=...)) whose n_experts "
                         f"({None if moe is None else moe['n_experts']}) and dp ({dp}) it divides")
    if cp > 1 and checkpoint == "selective":
        raise ValueError(f"rank {rank}: context parallel (cp={cp}) cannot be combined with checkpointing "
                         f"(selective): {compose.rule('cp', 'ckpt-selective').reason}")
    layers = cfg.n_layer + 2  # Embed, blocks, Head
    if pp * chunks > layers:
        raise ValueError(f"rank {rank}: {pp * chunks} pipeline stages (pp={pp} x chunks={chunks}) but the "
                         f"GPT has only {layers} layers (embedding, {cfg.n_layer} blocks, head); "
                         f"use pp <= {layers}")
    if batch_size is not None and batch_size % (dp * microbatches):
        raise ValueError(f"rank {rank}: global batch {batch_size} does not split into dp={dp} replicas x "
                         f"{microbatches} microbatches; use a batch size that is a multiple of "
                         f"{dp * microbatches}")
    if tp > 1 and cfg.n_head % tp:
        raise ValueError(f"rank {rank}: n_head={cfg.n_head} is not divisible by tp={tp}")


def token_loss_weights(ys, n_total: int, dp: int, ignore_index: int = -1) -> list[float]:
    """Per-microbatch loss weights dp * n_mb / N: `ys` are this replica's microbatch targets,
    `n_total` the global batch's valid-token count N (0 gives zero weights, as the serial mean over
    no tokens is 0 with no gradient). DDP divides the summed gradients by its dp ranks, so the sum
    over every replica and microbatch is the serial mean."""
    n_total = max(int(n_total), 1)
    return [dp * int((np.asarray(y) != ignore_index).sum()) / n_total for y in ys]


def build_model(cfg, tp_comm=None, sequence_parallel: bool = False):
    """(model, loss_fn): the serial GPT, or for tp > 1 a TPGPT -- the same initial weights, split --
    with its vocabulary-parallel loss (None: ``ops.cross_entropy``)."""
    if tp_comm is None or tp_comm.size == 1:
        return GPT(cfg), None
    model = TPGPT(cfg, tp_comm, sequence_parallel=sequence_parallel)
    return model, model.loss_fn


def techniques(mesh, sequence_parallel=False, checkpoint=None, precision=None, zero=None,
               offload=False, moe=None, fp8=None) -> list[str]:
    """The composition-matrix techniques a ``parallelize`` call applies, in its order."""
    out = ["tp"] if mesh.tp_size > 1 else []
    out += ["sp"] if sequence_parallel else []
    out += [] if moe is None else ["ep"]
    out += ["cp"] if mesh.cp_size > 1 else []
    out += [] if fp8 is None else ["fp8"]
    out += ["pp"] if mesh.pp_size > 1 else []
    out += [] if checkpoint is None else ["ckpt-selective" if checkpoint == "selective" else "ckpt-full"]
    out += [] if precision in (None, "fp32") else [precision]
    out += [f"zero{zero}"] if zero else (["ddp"] if mesh.dp_size * mesh.cp_size > 1 else [])
    return out + (["offload"] if offload else [])


@dataclass
class Parallelized:
    """What ``parallelize`` built on this rank; ``step(x, y)`` trains one global batch."""
    mesh: object
    model: object                      # this rank's whole model (TP shards, its experts)
    stage: PipelineStage | None        # the pipeline cut (None under ZeRO)
    dp: object                         # DDP or ZeRO over ``replicas`` (None: one replica)
    mp: MixedPrecision | None
    optimizer: object
    loss_fn: object                    # the base loss of the logits (vocabulary-parallel with TP)
    microbatches: int = 1
    instructions: list = field(default_factory=list)
    bounds: list = field(default_factory=list)
    experts: list = field(default_factory=list)
    layout: str = "zigzag"
    replicas: object = None

    def optimizer_step(self) -> None:
        """Wait for the data-parallel gradients, average the experts', step (through the masters)."""
        if isinstance(self.dp, ShardedDataParallel):
            self.dp.step()
            return
        if self.dp is not None:
            self.dp.wait_gradients()
        n = self.mesh.dp_size * self.mesh.cp_size
        for p in self.experts:  # each token's weight is dp*cp x its share, as for DDP's mean
            if p.grad is not None:
                p.grad = all_reduce(self.mesh.edp_cp, p.grad) / n
        if self.mp is not None:
            self.mp.step(self.optimizer)
            return
        self.optimizer.step()
        self.optimizer.zero_grad()

    def step(self, x, y) -> StepStats:
        """One training step on global batch (x, y): this replica's rows, this cp rank's tokens, the
        microbatches weighted by their valid tokens; ``loss`` is dp*cp x this replica's share."""
        mesh, m, x, y = self.mesh, self.microbatches, np.asarray(x), np.asarray(y)
        n_valid = int((y != -1).sum())
        n = x.shape[0] // mesh.dp_size  # this replica's rows
        x, y = x[mesh.dp_rank * n:(mesh.dp_rank + 1) * n], y[mesh.dp_rank * n:(mesh.dp_rank + 1) * n]
        if mesh.cp_size > 1:
            x, y = (shard_sequence(a, mesh.cp_rank, mesh.cp_size, self.layout) for a in (x, y))
        xs, ys = split_microbatches(x, m, mesh.world.rank), split_microbatches(y, m, mesh.world.rank)
        weights = token_loss_weights(ys, n_valid, mesh.dp_size * mesh.cp_size)
        if self.stage is None:
            return self._zero_step(xs, ys, weights)
        scale = 1.0 if self.mp is None else self.mp.scale  # the step may change it: read before
        stats = run_schedule(self.stage, mesh.pp, self.instructions, xs, ys, self.optimizer_step,
                             ddp=self.dp, loss_weights=weights)
        if stats.loss is not None and scale != 1.0:
            stats.loss /= scale
        return stats

    def _zero_step(self, xs, ys, weights) -> StepStats:
        """ZeRO (no pipeline): each microbatch's backward weighted by its valid tokens, the last syncs."""
        stats, total = StepStats(), 0.0
        for i, (x, y) in enumerate(zip(xs, ys)):
            loss = self.loss_fn(self.model(x), y)
            n = int((np.asarray(y) != -1).sum())
            if i < len(xs) - 1:
                with self.dp.no_sync():
                    self.dp.backward(loss, n_samples=n)
            else:
                self.dp.backward(loss, n_samples=n)
            total += float(to_host(loss.data)) * weights[i]
        self.optimizer_step()
        stats.loss = total
        return stats

    def layers(self) -> list:
        """(prefix, layer) of this rank's layers, prefixed with their index in the model."""
        if self.stage is None:
            return [(f"{i}.", layer) for i, layer in enumerate(self.model)]
        return [(f"{i}.", layer) for ids, layers in zip(self.stage.layer_ids, self.stage.chunks)
                for i, layer in zip(ids, layers)]

    def state(self) -> dict:
        """{serial-model name (before expert renaming): host array} of this rank's trained parameters:
        the fp32 masters under mixed precision, ZeRO's gathered parameters."""
        if isinstance(self.dp, ShardedDataParallel):
            return {k: np.asarray(to_host(v)) for k, v in self.dp.full_parameters().items()}
        named = list(self.stage.named_parameters())
        params = self.mp.master_params if self.mp is not None else [p for _, p in named]
        return {k: np.asarray(to_host(p.data)) for (k, _), p in zip(named, params)}

    def close(self) -> None:
        """Release the offloaded optimizer's threads and memory (a no-op otherwise)."""
        for o in (self.optimizer, getattr(self.dp, "optimizer", None)):
            if hasattr(o, "close"):
                o.close()


def _check_fp8_overlap_cp(rank, cfg, fp8, collective_matmul, sequence_parallel, tp, cp_mode) -> None:
    """FP8's recipe and fp32 model; collective matmul's sequence-parallel TP; the context-parallel mode."""
    if cp_mode not in CP_MODES:
        raise ValueError(f"rank {rank}: cp_mode={cp_mode!r}; use one of {', '.join(CP_MODES)}")
    if fp8 is not None and not isinstance(fp8, Fp8Recipe):
        raise ValueError(f"rank {rank}: fp8={fp8!r}; use None or an Fp8Recipe (e.g. Fp8Recipe('block'))")
    if collective_matmul and not (sequence_parallel and tp > 1):
        raise ValueError(f"rank {rank}: collective_matmul=True overlaps sequence parallelism's collectives; "
                         f"it needs sequence_parallel=True and tp > 1 (got sequence_parallel="
                         f"{sequence_parallel}, tp={tp})")
    if collective_matmul and fp8 is not None:
        raise ValueError(f"rank {rank}: collective_matmul=True with fp8: the FP8 wrappers run the "
                         "sequence-parallel collectives unfused; use one of them")
    if fp8 is not None and np.dtype(cfg.dtype) != np.float32:
        raise ValueError(f"rank {rank}: fp8 needs an fp32 model (its weights are the master weights), got "
                         f"dtype={cfg.dtype!r}; use dtype='float32'")


def _scaled(loss_fn, mp):
    """The last stage's loss under mixed precision: of fp32 logits, times the loss scale (what
    ``mp.loss`` and ``mp.backward`` do outside a pipeline)."""
    return lambda logits, y: loss_fn(ops.cast(logits, np.float32), y) * mp.scale


def _optimizer(name, lr, offload):
    """params -> the optimizer: by name, or AdamW with its state in host memory (``offload``)."""
    if offload:
        if name != "adamw":
            raise ValueError(f"offload=True is OffloadedAdamW: use optimizer='adamw', not {name!r}")
        return lambda ps: OffloadedAdamW(ps, None, lr=lr, weight_decay=0.0, where="host", prefetch=False)
    return lambda ps: make_optimizer(name, ps, lr)


def parallelize(cfg_or_model, mesh, *, microbatches: int = 1, schedule: str = "1f1b", chunks: int = 1,
                layer_costs=None, sequence_parallel: bool = False, layout: str = "zigzag",
                moe: dict | None = None, checkpoint: str | None = None, precision: str | None = None,
                zero: int | None = None, optimizer: str = "sgd", lr: float = 0.1, offload: bool = False,
                comm_hook=None, loss_scale: float | None = None, fp8: Fp8Recipe | None = None,
                collective_matmul: bool = False, cp_mode: str = "ring",
                ulysses_size: int | None = None) -> Parallelized:
    """Apply every technique to a GPT (a ``GPTConfig``, or a built serial ``GPT`` when tp = 1) on
    ``mesh`` in the module docstring's order; see ``train_3d`` for the options' meaning. ``zero``:
    1, 2 or 3 (ZeRO instead of DDP); ``precision``: "bf16" / "fp16" (None, "fp32": none);
    ``offload``: AdamW's state in host memory; ``comm_hook``: (state, hook) for DDP's buckets;
    ``loss_scale``: fp16's initial dynamic loss scale (None: ``DynamicLossScaler``'s default);
    ``fp8``: an ``Fp8Recipe`` for FP8 Linears (fp32 model; None: none); ``collective_matmul``: overlap
    the sequence-parallel collectives with the GEMMs (needs ``sequence_parallel``); ``cp_mode``:
    "ring" | "ulysses" | "hybrid" context parallelism, ``ulysses_size`` the hybrid's Ulysses groups."""
    built = isinstance(cfg_or_model, Module)
    cfg = cfg_or_model.config if built else cfg_or_model
    rank, dp, cp = mesh.world.rank, mesh.dp_size, mesh.cp_size
    check_3d(mesh.world.size, cfg, None, dp, mesh.pp_size, mesh.tp_size, microbatches, chunks, rank, cp,
             None, checkpoint, mesh.ep_size, moe)
    if built and mesh.tp_size > 1:
        raise ValueError(f"rank {rank}: tp={mesh.tp_size} builds its own sharded model (TPGPT): pass the "
                         "GPTConfig, not a built GPT")
    if precision not in (None, "fp32", "bf16", "fp16"):
        raise ValueError(f"rank {rank}: precision={precision!r}; use None, 'bf16' or 'fp16'")
    if zero not in (None, 0, 1, 2, 3):
        raise ValueError(f"rank {rank}: zero={zero!r}; use None (DDP) or a ZeRO stage 1, 2 or 3")
    if zero and comm_hook is not None:
        raise ValueError(f"rank {rank}: comm_hook is a hook on DDP's all-reduced buckets; ZeRO "
                         f"(zero={zero}) reduce-scatters them: pass comm_hook=None or use DDP")
    compose.check_pairs(techniques(mesh, sequence_parallel, checkpoint, precision, zero, offload, moe, fp8))
    _check_fp8_overlap_cp(rank, cfg, fp8, collective_matmul, sequence_parallel, mesh.tp_size, cp_mode)
    make_opt = _optimizer(optimizer, lr, offload)
    # 1. model transforms: TP / SP (overlapped: collective matmul), experts, context parallelism, FP8
    model, loss_fn = (cfg_or_model, None) if built else build_model(cfg, mesh.tp, sequence_parallel)
    loss_fn = loss_fn or ops.cross_entropy
    if collective_matmul:
        use_collective_matmul(model)
    if moe is not None:
        moe_gpt(model, ep=mesh.ep if mesh.ep_size > 1 else None, **moe)
    if cp > 1:
        context_parallel(model, mesh.cp, layout, mode=cp_mode, ulysses_size=ulysses_size)
    if fp8 is not None:
        fp8_linear(model, fp8)
    replicas = mesh.dp if cp == 1 else mesh.dp_cp  # the ranks whose gradients are averaged
    par = Parallelized(mesh, model, None, None, None, None, loss_fn, microbatches, layout=layout,
                       replicas=replicas)
    if zero:  # ZeRO shards a Module (its units): no pipeline cut, checkpointing on the model
        if checkpoint is not None:
            apply_checkpointing(model, checkpoint)
        par.dp = ZeRO(model, replicas, make_opt, stage=zero, broadcast_from=None)
        par.optimizer = par.dp.optimizer
        return par
    # 2. the pipeline cut and 3. activation checkpointing (per chunk)
    pp, n = mesh.pp_size, len(model)
    sched = make_schedule(schedule, pp, microbatches, chunks)  # its placement: which pieces a rank holds
    pieces = sched.placement.num_virtual
    par.bounds = (partition_uniform(n, pieces) if layer_costs is None
                  else partition_balanced(layer_costs, pieces))
    stage = par.stage = PipelineStage(model, par.bounds, mesh.pp_rank, pp, loss_fn=loss_fn,
                                      checkpoint=checkpoint, placement=sched.placement)
    par.instructions = sched[mesh.pp_rank]
    # 4. mixed precision over this stage's layers: its masters only, every rank agrees on a skip
    params = stage.parameters()
    if precision not in (None, "fp32"):
        layers = ModuleList([layer for _, layer in par.layers()])
        scaler = "auto" if loss_scale is None or precision != "fp16" else DynamicLossScaler(loss_scale)
        par.mp = MixedPrecision(layers, precision, scaler, groups=[mesh.tp, replicas, mesh.pp],
                                loss_fn=loss_fn)
        stage.loss_fn = _scaled(loss_fn, par.mp)
        params = par.mp.master_params
    # 5. data parallelism over the replicas; experts are synced over their own group at the step
    names = expert_names(par.layers())
    par.experts = [p for k, p in stage.named_parameters() if k in names]
    if dp * cp > 1:
        par.dp = DistributedDataParallel(stage, replicas, broadcast_from=None, ignore=par.experts)
        if comm_hook is not None:
            par.dp.register_comm_hook(*comm_hook)
    # 6. the optimizer, over what the others leave
    par.optimizer = make_opt(params)
    return par
