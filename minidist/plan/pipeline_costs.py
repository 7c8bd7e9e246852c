"""Measured F, B, W of a pipeline stage, and the step time the simulator predicts from them.

The zero-bubble formulas (`minidist.plan.schedules`) and the simulator need three costs per
microbatch and stage: F (the forward), B (the backward's input-gradient half, on the critical path)
and W (its weight-gradient half). `time_fbw` measures them on the stage itself, the way the runtime
runs them: `PipelineStage.forward`, then `split_backward.backward_input` (B), then the queue it
returns (`WeightGradQueue.run`, W), a few microbatches each, the median kept. `predict_step` runs a
schedule's instruction lists through `simulate` with those costs (the busiest stage's: it sets
every stage's pace), so a student can compare the prediction with a timed run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from minidist.autograd.tensor import Tensor
from minidist.parallel.pipeline.simulate import simulate
from minidist.parallel.pipeline.split_backward import backward_input


@dataclass(frozen=True)
class Costs:
    """Seconds of one microbatch through one stage: forward, input-gradient, weight-gradient."""
    F: float
    B: float
    W: float

    @property
    def backward(self) -> float:
        return self.B + self.W


def stage_input(model, start: int, ids):
    """What stage `start` receives for these token ids: the layers before it run once, no graph kept
    (every rank holds the whole initial model, so each computes its own input)."""
    x = ids
    for layer in list(model)[:start]:
        x = layer(x)
        x = x.data if isinstance(x, Tensor) else x
    return x


def time_fbw(stage, x, target=None, repeats: int = 3, chunk: int = 0, clock=time.perf_counter) -> Costs:
    """Median F, B, W seconds of microbatch `x` (token ids for the first stage, else an activation)
    through `chunk` of `stage` over `repeats` runs after one untimed warm-up (first calls allocate
    and fill caches); the last stage adds its loss (`target`). Gradients are put back to None after
    each run, so the stage is left as it was found."""
    rng = np.random.default_rng(0)
    f, b, w = [], [], []
    for _ in range(repeats + 1):
        inp = x if stage.is_first(chunk) else Tensor(x, requires_grad=True)
        t0 = clock()
        out = stage.forward(inp, chunk)
        if stage.is_last(chunk):
            out = stage.loss_fn(out, target)
        t1 = clock()
        seed = None if stage.is_last(chunk) else rng.standard_normal(out.shape).astype(out.dtype)
        queue = backward_input(out, seed, inputs=[inp] if isinstance(inp, Tensor) else [])
        t2 = clock()
        queue.run()
        t3 = clock()
        f.append(t1 - t0)
        b.append(t2 - t1)
        w.append(t3 - t2)
        for p in stage.parameters():
            p.grad = None
    return Costs(float(np.median(f[1:])), float(np.median(b[1:])), float(np.median(w[1:])))


def busiest(costs: list[Costs]) -> Costs:
    """The costs of the stage that sets the pace: the one with the most work per microbatch, F + B + W
    (the simulator takes one set of costs for every stage; the largest F, B and W taken from
    different stages would price a stage that does not exist)."""
    return max(costs, key=lambda c: c.F + c.B + c.W)


def predict_step(lists, costs: Costs, chunks: int = 1, comm_time: float = 0.0, opt_time: float = 0.0):
    """`simulate` of a schedule's instruction lists at these per-stage costs (each chunk 1/chunks of
    them), sends completing in the background as the runtime's do; returns the SimResult, whose
    makespan (including the optimizer step, `opt_time`) is the predicted step time."""
    v = chunks
    return simulate(lists, costs.F / v, costs.backward / v, comm_time, opt_time=opt_time,
                    input_time=costs.B / v, weight_time=costs.W / v, buffered_sends=True)
