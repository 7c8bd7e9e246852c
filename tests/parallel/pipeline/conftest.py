"""Shared by the pipeline tests: one training step of a schedule on threads, against the serial model."""

import numpy as np
import pytest

from minidist.comm import run
from minidist.nn import GPT, GPTConfig
from minidist.parallel.pipeline.catalog import make_schedule
from minidist.parallel.pipeline.partition import partition_uniform
from minidist.parallel.pipeline.runtime import run_schedule, split_microbatches
from minidist.parallel.pipeline.stage import PipelineStage

TINY = GPTConfig(vocab_size=16, block_size=4, n_layer=2, n_head=2, d_model=8, dtype="float64")


def _rank(comm, schedule, m, x, y, cfg):
    """Cut the model as the schedule's placement says (placement.num_virtual pieces) and run one step."""
    model = GPT(cfg)
    sched = make_schedule(schedule, comm.size, m)
    bounds = partition_uniform(len(model), sched.placement.num_virtual)
    stage = PipelineStage(model, bounds, comm.rank, comm.size, placement=sched.placement)
    stats = run_schedule(stage, comm, sched[comm.rank], split_microbatches(x, m), split_microbatches(y, m))
    return stats, {n: q.grad for n, q in stage.named_parameters()}


def pipeline_step(schedule, p, m, cfg, x, y):
    """One step of `schedule` on p thread ranks: (per-rank StepStats, {name: grad} over all ranks)."""
    results = run(_rank, ranks=p, schedule=schedule, m=m, x=x, y=y, cfg=cfg)
    return [s for s, _ in results], {n: g for _, grads in results for n, g in grads.items()}


def serial_step(cfg, x, y):
    """The serial model's (loss, {name: grad}) on the same batch."""
    model = GPT(cfg)
    loss = model.loss(x, y)
    loss.backward()
    return float(loss.item()), {n: q.grad for n, q in model.named_parameters()}


@pytest.fixture(scope="session")  # hypothesis tests may use it: no per-example state
def step_vs_serial():
    """step_vs_serial(schedule, p, m, n_layer, seed) -> (per-rank StepStats, max |grad - serial grad|,
    |loss - serial loss|), float64, a fresh random batch of 2m rows."""
    def go(schedule, p, m, n_layer, seed):
        cfg = TINY.replace(n_layer=n_layer)
        rng = np.random.default_rng(seed)
        x, y = rng.integers(0, 16, (2 * m, 4)), rng.integers(0, 16, (2 * m, 4))
        loss, want = serial_step(cfg, x, y)
        stats, got = pipeline_step(schedule, p, m, cfg, x, y)
        assert got.keys() == want.keys()
        losses = [s.loss for s in stats if s.loss is not None]
        assert len(losses) == 1  # exactly one rank computes the loss
        diff = max(float(np.abs(got[n] - want[n]).max()) for n in want)
        return stats, diff, abs(losses[0] - loss)
    return go
