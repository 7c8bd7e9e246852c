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
  parameters differ across an ep group, so DDP leaves them out; they are averaged over the ranks
  holding the same experts (`mesh.edp_cp`) at the optimizer step;
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

`train_3d` (also `train_mesh`) is the parallel run and `train_serial` its serial twin: one process,
the same global batches, the same optimizer. They give the same parameters up to float rounding (the summation
order differs: microbatch and replica partial sums); tests check 1e-9 in float64.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from minidist.comm import Mesh, all_reduce
from minidist.nn import GPT
from minidist.nn.optim import make_optimizer
from minidist.parallel.context.ring import context_parallel, shard_sequence
from minidist.parallel.data.ddp import DistributedDataParallel
from minidist.parallel.experts.dispatch import expert_names, moe_gpt
from minidist.parallel.pipeline.runtime import (
    PipelineStage,
    make_schedule,
    partition_balanced,
    partition_uniform,
    run_schedule,
    split_microbatches,
)
from minidist.parallel.tensor.gpt import TPGPT
from minidist.parallel.tensor.sharding import sharding_table, unshard
from minidist.testing import max_state_diff, train_serial  # noqa: F401  (their home; kept importable here)


def check_3d(world_size: int, cfg, batch_size: int, dp: int, pp: int, tp: int, microbatches: int,
             chunks: int = 1, rank: int = 0, cp: int = 1, seq_len: int | None = None,
             checkpoint: str | None = None, ep: int = 1, moe: dict | None = None) -> None:
    """Every error a mesh run can have, raised before any communication, naming what would be right."""
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
        raise ValueError(f"rank {rank}: checkpoint='selective' recomputes the serial attention core, but "
                         f"with cp={cp} attention is a ring (which keeps no T x T matrix to save); use "
                         "'full' or no checkpointing")
    layers = cfg.n_layer + 2  # Embed, blocks, Head
    if pp * chunks > layers:
        raise ValueError(f"rank {rank}: {pp * chunks} pipeline stages (pp={pp} x chunks={chunks}) but the "
                         f"GPT has only {layers} layers (embedding, {cfg.n_layer} blocks, head); "
                         f"use pp <= {layers}")
    if batch_size % (dp * microbatches):
        raise ValueError(f"rank {rank}: global batch {batch_size} does not split into dp={dp} replicas x "
                         f"{microbatches} microbatches; use a batch size that is a multiple of "
                         f"{dp * microbatches}")
    if tp > 1 and cfg.n_head % tp:
        raise ValueError(f"rank {rank}: n_head={cfg.n_head} is not divisible by tp={tp}")


def token_loss_weights(ys, n_total: int, dp: int, ignore_index: int = -1) -> list[float]:
    """Per-microbatch loss weights dp * n_mb / N (see the module docstring): `ys` are this replica's
    microbatch targets, `n_total` the global batch's valid-token count N (0 gives zero weights,
    as the serial mean over no tokens is 0 with no gradient)."""
    n_total = max(int(n_total), 1)
    return [dp * int((np.asarray(y) != ignore_index).sum()) / n_total for y in ys]


def build_model(cfg, tp_comm=None):
    """(model, loss_fn): the serial GPT, or for tp > 1 a TPGPT -- the same initial weights, split
    (its init draws the serial GPT's numbers and keeps this rank's slices) -- with its
    vocabulary-parallel loss, which the pipeline's last stage uses."""
    if tp_comm is None or tp_comm.size == 1:
        return GPT(cfg), None
    model = TPGPT(cfg, tp_comm)
    return model, model.loss_fn


@dataclass
class Result3D:
    """What `train_3d` returns on every rank."""
    mesh: Mesh
    stage: PipelineStage
    losses: list                                  # per step, mean over the global batch's valid tokens
    stats: list = field(default_factory=list)     # this rank's StepStats per step
    bounds: list = field(default_factory=list)    # the partition: (start, end) per virtual stage


def train_3d(comm, cfg, batches, dp: int = 1, pp: int = 1, tp: int = 1, microbatches: int = 1,
             schedule: str = "1f1b", lr: float = 0.1, optimizer: str = "sgd", chunks: int = 1,
             layer_costs=None, on_step=None, checkpoint: str | None = None, comm_hook=None,
             cp: int = 1, layout: str = "zigzag", ep: int = 1, moe: dict | None = None) -> Result3D:
    """Train `GPT(cfg)` on `batches` (list of global (x, y) batches, the same on every rank) with
    dp x pp x cp x tp = comm.size ranks (`layout`: the cp chunk assignment, zig-zag or contiguous).
    `layer_costs` (one per layer) selects the balanced partition.
    `on_step(step, stats)` is called after each step (e.g. to record traces). `checkpoint` is an
    activation-checkpointing policy ("full", "sqrt", "every_k", "selective") applied per stage.
    `comm_hook`: a (state, hook) pair (`minidist.parallel.data.compress`) for the data-parallel gradients.
    `moe`: make every block's MLP a mixture of experts (`minidist.parallel.experts.dispatch.moe_gpt`
    arguments, e.g. dict(n_experts=4, k=2)), split over ep groups carved from dp (`ep`); the expert-parallel
    parameters average over the ranks holding the same experts (mesh.edp_cp), not over dp_cp."""
    batch_size = batches[0][0].shape[0]
    check_3d(comm.size, cfg, batch_size, dp, pp, tp, microbatches, chunks, comm.rank, cp,
             batches[0][0].shape[1], checkpoint, ep, moe)
    mesh = Mesh(comm, dp=dp, pp=pp, tp=tp, cp=cp, ep=ep)
    model, loss_fn = build_model(cfg, mesh.tp)
    if moe is not None:
        moe_gpt(model, ep=mesh.ep if ep > 1 else None, **moe)
    if cp > 1:
        context_parallel(model, mesh.cp, layout)
    replicas = mesh.dp if cp == 1 else mesh.dp_cp  # the ranks whose gradients are averaged
    n = len(model)
    bounds = partition_uniform(n, pp * chunks) if layer_costs is None else partition_balanced(layer_costs,
                                                                                             pp * chunks)
    stage = PipelineStage(model, bounds, mesh.pp_rank, pp, loss_fn=loss_fn, checkpoint=checkpoint)
    params = stage.parameters()
    opt = make_optimizer(optimizer, params, lr)
    instructions = make_schedule(schedule, pp, microbatches, chunks)[mesh.pp_rank]
    # data parallelism: DDP's buckets, started during each chunk's last backward (see run_schedule)
    experts = expert_parameters(stage)
    ddp = None
    if dp * cp > 1:  # experts are left out of DDP (not the same experts on every replica): synced below
        for p in experts:
            p.requires_grad = False
        try:
            ddp = DistributedDataParallel(stage, replicas, broadcast_from=None)
        finally:
            for p in experts:
                p.requires_grad = True
    if ddp is not None and comm_hook is not None:
        ddp.register_comm_hook(*comm_hook)

    def optimizer_step():
        if ddp is not None:
            ddp.wait_gradients()
        for p in experts:  # each token's weight is dp*cp x its share, as for DDP's mean
            if p.grad is not None:
                p.grad = all_reduce(mesh.edp_cp, p.grad) / (dp * cp)
        opt.step()
        opt.zero_grad()

    rows = batch_size // dp
    losses, all_stats = [], []
    for step, (x, y) in enumerate(batches):
        mine = slice(mesh.dp_rank * rows, (mesh.dp_rank + 1) * rows)
        x, y = np.asarray(x)[mine], np.asarray(y)[mine]
        n_valid = int((np.asarray(batches[step][1]) != -1).sum())
        if cp > 1:
            x, y = (shard_sequence(a, mesh.cp_rank, cp, layout) for a in (x, y))
        xs = split_microbatches(x, microbatches, comm.rank)
        ys = split_microbatches(y, microbatches, comm.rank)
        weights = token_loss_weights(ys, n_valid, dp * cp)
        stats = run_schedule(stage, mesh.pp, instructions, xs, ys, optimizer_step, ddp=ddp,
                             loss_weights=weights)
        all_stats.append(stats)
        if on_step is not None:
            on_step(step, stats)
        losses.append(stats.loss)
    last = mesh.rank_of(pp - 1, 0, 0)
    if mesh.pp_rank == pp - 1 and mesh.tp_rank == 0 and dp * cp > 1:  # each is dp*cp x its token share
        losses = list(all_reduce(replicas, np.array(losses, np.float64), op="mean"))
    losses = [float(v) for v in comm.bcast_obj(losses, root=last)]
    return Result3D(mesh=mesh, stage=stage, losses=losses, stats=all_stats, bounds=bounds)


def stage_layers(stage) -> list:
    """(prefix, layer) of every layer of a pipeline stage, prefixed with its index in the model."""
    return [(f"{i}.", layer) for ids, layers in zip(stage.layer_ids, stage.chunks)
            for i, layer in zip(ids, layers)]


def expert_parameters(stage) -> list:
    """The stage's expert-parallel parameters (none without ep)."""
    names = expert_names(stage_layers(stage))
    return [p for k, p in stage.named_parameters() if k in names]


def gather_full_state(comm, result: Result3D) -> dict | None:
    """The whole model's parameters (serial names, full unsharded arrays) on rank 0; None elsewhere."""
    mesh, stage = result.mesh, result.stage
    sd = {k: np.asarray(p.backend.to_host(p.data)) for k, p in stage.named_parameters()}
    names = expert_names(stage_layers(stage))  # expert-parallel: local name -> the serial model's
    if mesh.tp_size > 1:
        table = {k: s for ids, layers in zip(stage.layer_ids, stage.chunks) for i, layer in zip(ids, layers)
                 for k, s in sharding_table(layer, prefix=f"{i}.").items()}
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
