"""Train a pipeline that re-cuts itself: profile each layer, cut by min-max, move the layers.

    run = train_pipeline_balanced(comm, cfg, batches, microbatches=4, slow=Slowdown("layer=3,factor=4"))

Each rank runs its stage of a 1F1B pipeline as a ``ProfiledStage`` (``profile.py``: per-layer
seconds measured while training). Every step the stages agree on the whole model's per-layer cost
and memory with one all-reduce of 2·L numbers (each stage fills in its own layers). Every ``every``
steps the median over a window goes to ``partition_balanced`` (the min-max contiguous cut, within a
memory cap); the new cut is taken when ``step_time`` says it is faster by more than ``margin`` and
the move ``pays_off``, and ``move_layers`` (``repartition.py``) makes it at the step boundary.
Dropout > 0 is refused: the stages' dropout streams would not match the serial twin's anyway, so
there is no RNG state to move. Every rank builds the whole GPT from the same seed, so training with
moves equals the serial twin.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from minidist.comm import all_reduce
from minidist.nn import GPT
from minidist.nn.optim import make_optimizer
from minidist.parallel.balance.profile import ProfiledStage
from minidist.parallel.balance.repartition import (
    layer_memory_bytes,
    move_layers,
    pays_off,
    stage_costs,
    stage_of,
    step_time,
)
from minidist.parallel.pipeline.partition import partition_balanced, partition_uniform
from minidist.parallel.pipeline.runtime import run_schedule, split_microbatches
from minidist.parallel.pipeline.schedule import one_f_one_b
from minidist.trace.spans import now


@dataclass
class PipelineRun:
    """What ``train_pipeline_balanced`` returns on every rank."""
    stage: ProfiledStage
    losses: list = field(default_factory=list)
    step_seconds: list = field(default_factory=list)   # per step, the rank's clock (the slowest stage's pace)
    bounds: list = field(default_factory=list)         # the partition each step ran with
    layer_seconds: list = field(default_factory=list)  # per step: agreed fwd+bwd seconds of every layer
    moves: list = field(default_factory=list)          # (after step, old, new, bytes moved in all, seconds)


def train_pipeline_balanced(comm, cfg, batches, microbatches: int = 4, lr: float = 0.1,
                            optimizer: str = "sgd", slow=None, balance: bool = True, every: int = 2,
                            window: int = 2, margin: float = 0.1, memory_cap: float | None = None,
                            bandwidth: float = 1e9, plan=None, on_step=None) -> PipelineRun:
    """Train ``GPT(cfg)`` as a ``comm.size``-stage 1F1B pipeline, re-partitioned while it runs.

    Starts from the uniform cut. Every ``every`` steps: the min-max cut of the window's median layer
    costs (within ``memory_cap`` bytes per stage, if given) replaces the current one if it predicts a
    slowest stage shorter by more than ``margin`` and ``pays_off`` (move time = bytes / ``bandwidth``).
    ``plan(step)`` (tests): the bounds to use from that step on (or None to keep them), instead.
    ``slow``: a ``Slowdown`` emulating heavy layers (None: nothing slowed)."""
    if cfg.dropout:
        raise ValueError(f"rank {comm.rank}: re-partitioning needs dropout=0 (got {cfg.dropout}): the serial "
                         "twin draws dropout masks from one stream, the stages from their own")
    p, model = comm.size, GPT(cfg)
    n = len(model)
    if slow is not None:
        slow.check_world(p, n, comm.rank)
    bounds = partition_uniform(n, p)
    stage = ProfiledStage(model, bounds, comm.rank, p, slow=slow)
    opt = make_optimizer(optimizer, stage.parameters(), lr)
    instructions = one_f_one_b(p, microbatches)[comm.rank]
    run = PipelineRun(stage=stage)
    history = []
    for step, (x, y) in enumerate(batches):
        stage.step = step
        stage.reset()
        xs = split_microbatches(x, microbatches, comm.rank)
        ys = split_microbatches(y, microbatches, comm.rank)
        valid = max(int((np.asarray(y) != -1).sum()), 1)  # each microbatch's share of the valid tokens
        weights = [int((np.asarray(v) != -1).sum()) / valid for v in ys]

        def optimizer_step(opt=opt):
            opt.step()
            opt.zero_grad()

        t0 = now()
        stats = run_schedule(stage, comm, instructions, xs, ys, optimizer_step, loss_weights=weights)
        mine = np.zeros(2 * n)
        for i, s in stage.layer_seconds().items():
            mine[i] = s
            layer = model[i]
            mine[n + i] = layer_memory_bytes(layer, optimizer, stage.act_bytes[i], min(microbatches, p))
        agreed = all_reduce(comm, mine, op="sum")
        run.step_seconds.append(now() - t0)
        run.losses.append(stats.loss)
        run.bounds.append(list(bounds))
        run.layer_seconds.append(agreed[:n].tolist())
        history.append(agreed)
        new = None
        if plan is not None:
            new = plan(step)
        elif balance and (step + 1) % every == 0 and step + 1 < len(batches):
            recent = np.median(history[-window:], axis=0)
            costs, memory = recent[:n], recent[n:]
            best = partition_balanced(costs, p, memory if memory_cap else None, memory_cap)
            t_now = step_time(stage_costs(bounds, costs), microbatches)
            t_new = step_time(stage_costs(best, costs), microbatches)
            moved = sum(memory[i] for i in range(n) if stage_of(bounds, i) != stage_of(best, i))
            if t_new < (1 - margin) * t_now and pays_off(t_now, t_new, len(batches) - step - 1,
                                                          moved / bandwidth):
                new = best
        if new is not None and list(map(tuple, new)) != list(map(tuple, bounds)):
            t1 = now()
            stage, opt, sent = move_layers(comm, model, bounds, [tuple(b) for b in new], opt,
                                           {"slow": slow}, optimizer, lr)
            seconds = now() - t1
            sent = int(all_reduce(comm, np.array([sent], np.int64), op="sum")[0])  # every stage's
            run.moves.append((step, list(bounds), [tuple(b) for b in new], sent, seconds))
            bounds = [tuple(b) for b in new]
        run.stage = stage
        if on_step is not None:
            on_step(step, run)
    # every stage's loss is only on the last one: share it
    run.losses = [float(v) for v in comm.bcast_obj(run.losses, root=p - 1)]
    return run


def gather_stage_states(comm, run: PipelineRun) -> dict | None:
    """The whole model's parameters (serial names) on rank 0, from each stage's current layers."""
    mine = {k: np.array(q.backend.to_host(q.data)) for k, q in run.stage.named_parameters()}
    parts = comm.gather_obj(mine, 0)
    if parts is None:
        return None
    full = {}
    for part in parts:
        full.update(part)
    return full
