"""Training over any mesh: ``train_mesh`` (also ``train_3d``) is ``parallelize`` plus the step loop.

Every rank is one cell of the mesh (``minidist.comm.Mesh``: rank = ((pp_rank * dp + dp_rank) * cp +
cp_rank) * tp + tp_rank): tp ranks hold shards of the same layers, pp ranks consecutive stages, cp
ranks different tokens of the same sequences, dp replicas 1/dp of the global batch (experts split
over ep groups carved from dp). ``parallelize`` builds every technique in its one order from one
checked ``Options``; each microbatch's loss weighs its valid tokens (``token_loss_weights``), so the
sum over replicas and microbatches is the serial mean. ``minidist.nn.serial.train_serial`` is the
serial twin (the same global batches, one process): equal up to float rounding (1e-9 in float64).
``gather_full_state`` puts the trained model back together on rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from minidist.comm import Mesh, all_reduce
from minidist.nn.optim import make_optimizer  # noqa: F401  (its home; kept importable here)
from minidist.nn.serial import max_state_diff, train_serial  # noqa: F401  (their home; kept importable here)
from minidist.parallel.experts.model import expert_names
from minidist.parallel.parallelize import (  # noqa: F401  (the mesh's pieces, importable from here)
    Options,
    Parallelized,
    build_model,
    check,
    check_3d,
    parallelize,
    token_loss_weights,
)
from minidist.parallel.pipeline.runtime import PipelineStage
from minidist.parallel.tensor.sharding import sharding_table, unshard


@dataclass
class Result3D:
    """What ``train_mesh`` returns on every rank."""
    mesh: Mesh
    stage: PipelineStage | None                   # None under ZeRO (no pipeline cut)
    losses: list                                  # per step, mean over the global batch's valid tokens
    stats: list = field(default_factory=list)     # this rank's StepStats per step
    bounds: list = field(default_factory=list)    # the partition: (start, end) per virtual stage
    parallel: Parallelized | None = None          # what parallelize built (model, dp, mp, optimizer)


def train_mesh(comm, cfg, batches, options: Options | None = None, on_step=None, **flags) -> Result3D:
    """Train ``GPT(cfg)`` on ``batches`` (global (x, y) batches, the same on every rank) over the mesh
    of ``options`` -- checked before any rank started (``parallelize.check``) -- or of ``flags``,
    ``Options``' fields checked here (``checkpoint=``: the old name of ``recompute=``).
    ``on_step(step, stats)`` is called after each step (e.g. to record traces)."""
    if options is None:
        x = batches[0][0]
        options = check(Options.of(**flags), cfg, comm.size, x.shape[0], x.shape[1], rank=comm.rank)
    elif flags:
        raise TypeError(f"train_mesh takes Options or flags, not both (got {sorted(flags)})")
    mesh = Mesh(comm, **options.mesh)
    par = parallelize(cfg, mesh, options)
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
    pp = options.pp
    loss_pp = pp - 1 if par.stage is None else par.stage.placement.rank_of(par.stage.num_virtual - 1)
    last = mesh.rank_of(loss_pp, 0, 0)  # the pipeline rank computing the loss (rank 0 in a V)
    if mesh.pp_rank == loss_pp and mesh.tp_rank == 0 and options.dp * options.cp > 1:  # dp*cp x its share
        losses = list(all_reduce(par.replicas, np.array(losses, np.float64), op="mean"))
    losses = [float(v) for v in comm.bcast_obj(losses, root=last)]
    return Result3D(mesh=mesh, stage=par.stage, losses=losses, stats=all_stats, bounds=par.bounds,
                    parallel=par)


train_3d = train_mesh  # training over any mesh dp x pp x cp x tp: one function, two names


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
