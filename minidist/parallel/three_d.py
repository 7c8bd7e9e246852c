"""Training over any mesh: data x pipeline x context x tensor parallel training of a GPT on a `Mesh`.

Every rank is one cell of the mesh (`minidist.comm.Mesh`:
rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank; with cp = 1 the 3D order):

* **tensor (tp)**: the tp ranks of a cell hold shards of the same layers (`TPGPT`, Megatron-style),
  and do their all-reduces inside the layers' forward and backward;
* **pipeline (pp)**: the model's layer list is cut into pp stages (`minidist.parallel.pipeline.runtime`);
  each stage runs a schedule (GPipe or 1F1B) over the microbatches, sending activations forward
  and gradients back to the same (dp, tp) coordinate of the neighbouring stage;
* **context (cp)**: the cp ranks of a cell hold different tokens of the same sequences (zig-zag
  chunks, `minidist.parallel.context.ring`); attention passes keys and values round their ring. Their
  gradients are partial sums over tokens, so they are averaged together with dp's (group dp_cp);
* **experts (ep, carved from dp)**: with ``moe=``, every block's MLP is a mixture of experts split
  over ep consecutive dp ranks (`minidist.parallel.experts.dispatch`: tokens travel by all-to-all). Expert
  parameters differ across an ep group, so DDP ignores them (its ``ignore=``); they are averaged
  over the ranks holding the same experts (`mesh.edp_cp`) at the optimizer step;
* **data (dp)**: dp replicas of the whole pipeline each take 1/dp of the global batch. Each stage
  is wrapped in `DistributedDataParallel` over its dp group: a chunk's gradients are complete after
  its last microbatch's backward, so that backward alone syncs, and its buckets' all-reduces run
  while the rest of it computes. At the schedule's `OptimizerStep` every replica waits for them and
  takes the same optimizer step.

**Ignored targets.** The serial loss is the mean over the global batch's N valid tokens (targets
of -1 don't count). Microbatch mb of a replica holds n_mb of them, so its loss is weighted by
n_mb / N, not 1/m (`token_loss_weights`); DDP then averages the replicas' gradients (divides by dp),
so the weight is dp * n_mb / N, and the sum over every replica and microbatch is the serial mean.
With context parallelism a rank's microbatch holds only its own tokens, and DDP averages over
dp x cp ranks: the weight is dp * cp * n_mb / N.

`train_3d` (also `train_mesh`) is `minidist.parallel.parallelize.parallelize` (which builds every
technique in its one order, ZeRO, mixed precision and host offload included) plus the step loop;
`train_serial` is its serial twin: one process, the same global batches, the same optimizer.
They give the same parameters up to float rounding (the summation order differs: microbatch and
replica partial sums); tests check 1e-9 in float64.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from minidist.comm import Mesh, all_reduce
from minidist.nn.optim import make_optimizer  # noqa: F401  (its home; kept importable here)
from minidist.nn.serial import max_state_diff, train_serial  # noqa: F401  (their home; kept importable here)
from minidist.parallel.experts.model import expert_names
from minidist.parallel.parallelize import (  # noqa: F401  (the mesh's pieces, importable from here)
    Parallelized,
    build_model,
    check_3d,
    parallelize,
    token_loss_weights,
)
from minidist.parallel.pipeline.runtime import PipelineStage
from minidist.parallel.tensor.sharding import sharding_table, unshard


@dataclass
class Result3D:
    """What `train_3d` returns on every rank."""
    mesh: Mesh
    stage: PipelineStage | None                   # None under ZeRO (no pipeline cut)
    losses: list                                  # per step, mean over the global batch's valid tokens
    stats: list = field(default_factory=list)     # this rank's StepStats per step
    bounds: list = field(default_factory=list)    # the partition: (start, end) per virtual stage
    parallel: Parallelized | None = None          # what parallelize built (model, dp, mp, optimizer)


def train_3d(comm, cfg, batches, dp: int = 1, pp: int = 1, tp: int = 1, microbatches: int = 1,
             schedule: str = "1f1b", lr: float = 0.1, optimizer: str = "sgd", chunks: int = 1,
             layer_costs=None, on_step=None, checkpoint: str | None = None, comm_hook=None,
             cp: int = 1, layout: str = "zigzag", ep: int = 1, moe: dict | None = None,
             zero: int | None = None, precision: str | None = None, offload: bool = False,
             sequence_parallel: bool = False, loss_scale: float | None = None, fp8=None,
             collective_matmul: bool = False, cp_mode: str = "ring",
             ulysses_size: int | None = None) -> Result3D:
    """Train `GPT(cfg)` on `batches` (list of global (x, y) batches, the same on every rank) with
    dp x pp x cp x tp = comm.size ranks (`layout`: the cp chunk assignment, zig-zag or contiguous).
    `layer_costs` (one per layer) selects the balanced partition.
    `on_step(step, stats)` is called after each step (e.g. to record traces). `checkpoint` is an
    activation-checkpointing policy ("full", "sqrt", "every_k", "selective") applied per stage.
    `comm_hook`: a (state, hook) pair (`minidist.parallel.data.compress`) for the data-parallel gradients.
    `moe`: make every block's MLP a mixture of experts (`minidist.parallel.experts.dispatch.moe_gpt`
    arguments, e.g. dict(n_experts=4, k=2)), split over ep groups carved from dp (`ep`); the expert-parallel
    parameters average over the ranks holding the same experts (mesh.edp_cp), not over dp_cp.
    `zero` (1, 2, 3: ZeRO instead of DDP), `precision` ("bf16", "fp16"), `offload` (AdamW's state in
    host memory), `sequence_parallel`, `loss_scale` (fp16's initial), `fp8` (an Fp8Recipe: FP8 Linears),
    `collective_matmul` (overlapped sequence parallelism) and `cp_mode` / `ulysses_size` (ring, Ulysses
    or hybrid context parallelism) are applied as `parallelize`
    does, where the composition matrix (`minidist.parallel.compose`) allows them: a refused pair
    raises before anything is built."""
    batch_size = batches[0][0].shape[0]
    check_3d(comm.size, cfg, batch_size, dp, pp, tp, microbatches, chunks, comm.rank, cp,
             batches[0][0].shape[1], checkpoint, ep, moe)
    mesh = Mesh(comm, dp=dp, pp=pp, tp=tp, cp=cp, ep=ep)
    par = parallelize(cfg, mesh, microbatches=microbatches, schedule=schedule, chunks=chunks,
                      layer_costs=layer_costs, sequence_parallel=sequence_parallel, layout=layout, moe=moe,
                      checkpoint=checkpoint, precision=precision, zero=zero, optimizer=optimizer, lr=lr,
                      offload=offload, comm_hook=comm_hook, loss_scale=loss_scale, fp8=fp8,
                      collective_matmul=collective_matmul, cp_mode=cp_mode, ulysses_size=ulysses_size)
    losses, all_stats = [], []
    try:
        for step, (x, y) in enumerate(batches):
            stats = par.step(x, y)
            all_stats.append(stats)
            if on_step is not None:
                on_step(step, stats)
            losses.append(stats.loss)
    finally:
        par.close()
    loss_pp = pp - 1 if par.stage is None else par.stage.placement.rank_of(par.stage.num_virtual - 1)
    last = mesh.rank_of(loss_pp, 0, 0)  # the pipeline rank computing the loss (rank 0 in a V)
    if mesh.pp_rank == loss_pp and mesh.tp_rank == 0 and dp * cp > 1:  # each is dp*cp x its token share
        losses = list(all_reduce(par.replicas, np.array(losses, np.float64), op="mean"))
    losses = [float(v) for v in comm.bcast_obj(losses, root=last)]
    return Result3D(mesh=mesh, stage=par.stage, losses=losses, stats=all_stats, bounds=par.bounds,
                    parallel=par)


def stage_layers(stage) -> list:
    """(prefix, layer) of every layer of a pipeline stage, prefixed with its index in the model."""
    return [(f"{i}.", layer) for ids, layers in zip(stage.layer_ids, stage.chunks)
            for i, layer in zip(ids, layers)]


def gather_full_state(comm, result: Result3D) -> dict | None:
    """The whole model's parameters (serial names, full unsharded arrays; the fp32 masters under
    mixed precision) on rank 0; None elsewhere."""
    mesh, par = result.mesh, getattr(result, "parallel", None)  # a (mesh, stage) pair: an exercise's
    if par is None:
        sd = {k: np.asarray(p.backend.to_host(p.data)) for k, p in result.stage.named_parameters()}
        layers = stage_layers(result.stage)
    else:
        sd, layers = par.state(), par.layers()
    names = expert_names(layers)  # expert-parallel: local name -> the serial model's
    if mesh.tp_size > 1:
        table = {k: s for prefix, layer in layers for k, s in sharding_table(layer, prefix=prefix).items()}
        shards = mesh.tp.gather_obj(sd, root=0)
        sd = dict(unshard(shards, table)) if shards is not None else {}
    sd = {names.get(k, k): v for k, v in sd.items()}
    first = mesh.cp_rank == 0 and mesh.tp_rank == 0
    mine = sd if first and mesh.dp_rank == 0 else {}
    if first and 0 < mesh.dp_rank < mesh.ep_size:  # the other ep ranks' experts
        mine = {names[k]: sd[names[k]] for k in names}
    parts = comm.gather_obj(mine, root=0)
    if parts is None:
        return None
    full = {}
    for part in parts:
        full.update(part)
    return full


train_mesh = train_3d  # training over any mesh dp x pp x cp x tp: one function, two names
