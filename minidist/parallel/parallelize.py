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

This file is ``parallelize`` itself; beside it, re-exported here: its argument checks
(``minidist/parallel/parallelize_checks.py``), what it builds from -- model, optimizer, scaled loss
(``minidist/parallel/parallelize_parts.py``) -- and what it returns, ``Parallelized`` and its step
(``minidist/parallel/parallelized.py``).
"""

from __future__ import annotations

from minidist.autograd import ops
from minidist.nn.module import Module, ModuleList
from minidist.parallel.context.model import context_parallel
from minidist.parallel.data.ddp import DistributedDataParallel
from minidist.parallel.data.zero import ZeRO
from minidist.parallel.experts.model import expert_names, moe_gpt
from minidist.parallel.memory.fp8 import Fp8Recipe, fp8_linear
from minidist.parallel.memory.precision import DynamicLossScaler, MixedPrecision
from minidist.parallel.memory.recompute import apply_checkpointing
from minidist.parallel.parallelize_checks import check_3d, check_options, techniques
from minidist.parallel.parallelize_parts import build_model, optimizer_factory, scaled_loss
from minidist.parallel.parallelized import Parallelized, token_loss_weights
from minidist.parallel.pipeline.runtime import (
    PipelineStage,
    make_schedule,
    partition_for,
    partition_uniform,
)
from minidist.parallel.tensor.collective_matmul import use_collective_matmul

__all__ = ["Parallelized", "build_model", "check_3d", "check_options", "optimizer_factory", "parallelize",
           "scaled_loss", "techniques", "token_loss_weights"]


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
    dp, cp = mesh.dp_size, mesh.cp_size
    check_options(mesh, cfg, built, microbatches=microbatches, chunks=chunks,
                  sequence_parallel=sequence_parallel, moe=moe, checkpoint=checkpoint, precision=precision,
                  zero=zero, offload=offload, comm_hook=comm_hook, fp8=fp8,
                  collective_matmul=collective_matmul, cp_mode=cp_mode)
    make_opt = optimizer_factory(optimizer, lr, offload)
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
                  else partition_for(layer_costs, sched.placement))  # balances ranks, not pieces
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
        stage.loss_fn = scaled_loss(loss_fn, par.mp)
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
