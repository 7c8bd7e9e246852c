"""Exercise 11 (capstone): 3D parallelism -- assemble dp x pp x tp training from minidist's pieces.

Every rank is one cell of a mesh: rank = (pp_rank * dp + dp_rank) * tp + tp_rank. Its tp group
holds shards of the same layers (Megatron), its pp neighbours run the stages before and after it
(1F1B over microbatches), its dp group averages gradients with the replicas (DDP). The result must
equal the serial twin: one GPT trained on the whole global batch.

Estimated time: 2 h (coordinates 10 min, loss weights 20 min, train_3d 1.5 h)
Points: mesh_coordinates 1, loss_weights 2, train_3d 5.
Grade it:  python -m minidist.grade three_d
The grader trains a tiny float64 GPT for 2 steps on meshes of 1..8 thread ranks (some targets
ignored, as -1) and compares the parameters (gathered to rank 0) and losses with ``train_serial``.
Lesson: lessons/05-pipeline.md and `python -m minidist.lessons.pipeline --ranks 8 --dp 2 --pp 2
--tp 2`; minidist's answer is ``train_3d`` in minidist/parallel/three_d.py (built on ``parallelize``),
so try before you look.

The pieces (read their docstrings): ``Mesh(comm, dp=, pp=, tp=)`` (``.dp``, ``.pp``, ``.tp``
communicators, ``.dp_rank``, ``.pp_rank``, ``.tp_rank``); ``build_model(cfg, tp_comm)`` -> (model,
loss_fn); ``partition_uniform(n_layers, pp)``; ``PipelineStage(model, bounds, pp_rank, pp,
loss_fn=loss_fn)``; ``make_schedule("1f1b", pp, microbatches)[pp_rank]``;
``split_microbatches(x, m)``; ``DistributedDataParallel(stage, mesh.dp, broadcast_from=None)``
(``.wait_gradients()``); ``make_optimizer("sgd", params, lr)``; ``run_schedule(stage, mesh.pp,
instructions, xs, ys, optimizer_step, ddp=ddp, loss_weights=weights)`` -> stats with ``.loss``.
"""

import numpy as np  # noqa: F401  (you will need it)

from minidist.comm import Mesh  # noqa: F401
from minidist.nn.optim import make_optimizer  # noqa: F401
from minidist.parallel.data.ddp import DistributedDataParallel  # noqa: F401
from minidist.parallel.pipeline.catalog import make_schedule  # noqa: F401
from minidist.parallel.pipeline.partition import partition_uniform  # noqa: F401
from minidist.parallel.pipeline.runtime import run_schedule, split_microbatches  # noqa: F401
from minidist.parallel.pipeline.stage import PipelineStage  # noqa: F401
from minidist.parallel.three_d import build_model  # noqa: F401


def mesh_coordinates(rank, dp, pp, tp):
    """(dp_rank, pp_rank, tp_rank) of ``rank`` in a dp x pp x tp mesh numbered
    rank = (pp_rank * dp + dp_rank) * tp + tp_rank (tp ranks adjacent: they talk the most)."""
    raise NotImplementedError


def loss_weights(ys, n_total, dp):
    """The weight of each microbatch's mean loss, so that the sum over every replica and microbatch,
    after DDP averages the dp replicas' gradients, is the serial loss: the mean over the global
    batch's ``n_total`` valid targets (targets of -1 are ignored). ``ys`` are this replica's
    microbatch targets; microbatch j holds n_j valid targets. Returns a list of floats:
    dp * n_j / n_total (all 0.0 when n_total is 0). Does not modify its inputs."""
    raise NotImplementedError


def train_3d(comm, cfg, batches, dp, pp, tp, microbatches, lr):
    """Train ``GPT(cfg)`` with SGD(lr) on ``batches`` (a list of global (x, y) batches, the same on
    every rank) over dp x pp x tp = comm.size ranks, 1F1B with ``microbatches`` per replica.

    Replica dp_rank takes rows dp_rank*B/dp .. (dp_rank+1)*B/dp of each batch, cuts them into
    microbatches, weights their losses by ``loss_weights``, runs the schedule; the optimizer step
    (inside the schedule) waits for DDP's gradients, steps, zeroes the gradients.
    Returns (mesh, stage): the grader gathers the full model from them.
    Does not modify its inputs.
    """
    raise NotImplementedError
