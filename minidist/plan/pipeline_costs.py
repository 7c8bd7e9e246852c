"""Measured F, B, W of a pipeline stage, and the step time the simulator predicts from them.

The zero-bubble formulas (`minidist.plan.schedules`) and the simulator need three costs per
microbatch and stage: F (the forward), B (the backward's input-gradient half, on the critical path)
and W (its weight-gradient half). `time_fbw` measures them on the stage itself, the way the runtime
runs them: `PipelineStage.forward`, then `split_backward.backward_input` (B), then the queue it
returns (`WeightGradQueue.run`, W), a few microbatches each, the median kept. `predict_step` runs a
schedule's instruction lists through `simulate` with those costs (the busiest stage's: it sets
every stage's pace), so a student can compare the prediction with a timed run; `cut_for_schedule`
asks the same simulator which cut of the model a schedule runs fastest on.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import numpy as np

from minidist.autograd.tensor import Tensor
from minidist.parallel.pipeline.partition import partition_for, rank_loads
from minidist.parallel.pipeline.placement import placement_of
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


def predict_step(lists, costs: Costs, chunks: int = 1, comm_time: float = 0.0, opt_time: float = 0.0,
                 piece_scale=None):
    """`simulate` of a schedule's instruction lists at these per-stage costs (each chunk 1/chunks of
    them; `piece_scale`: each piece's share of that, for unequal pieces), sends completing in the
    background as the runtime's do; returns the SimResult, whose makespan (including the optimizer
    step, `opt_time`) is the predicted step time."""
    v = chunks
    return simulate(lists, costs.F / v, costs.backward / v, comm_time, opt_time=opt_time,
                    input_time=costs.B / v, weight_time=costs.W / v, buffered_sends=True,
                    piece_scale=piece_scale)


def cut_for_schedule(per_layer, lists, split: Costs = Costs(1.0, 1.0, 1.0), memory=None,
                     cap: float | None = None, max_cuts: int = 20_000):
    """The cut of the model (one cost per layer, forward + backward) whose simulated step under this
    schedule is shortest: every contiguous cut into the placement's pieces, each piece's F, B, W its
    cost shared as `split` shares a stage's. Balancing the ranks' loads (`partition_for`) fixes the
    steady state only; a V whose rank holds a tiny piece and a huge one waits in its fill and drain,
    which the simulator sees. With `memory` (per layer) and `cap`: no rank's pieces above `cap`.
    Past `max_cuts` cuts (long models), `partition_for`'s cut."""
    placement = placement_of(lists)
    n, k = len(per_layer), placement.num_virtual
    fallback = partition_for(per_layer, placement, memory, cap)  # also: bad sizes and caps refused here
    total = split.F + split.B + split.W
    if not total > 0:
        raise ValueError(f"cut_for_schedule: split {split} must share a positive cost among F, B and W")
    if math.comb(n - 1, k - 1) > max_cuts:
        return fallback
    capped = memory is not None and cap is not None
    share = Costs(split.F / total, split.B / total, split.W / total)
    best = None
    for inner in itertools.combinations(range(1, n), k - 1):
        ends = (0, *inner, n)
        bounds = list(zip(ends[:-1], ends[1:]))
        if capped and max(rank_loads(bounds, memory, placement)) > cap:
            continue
        step = predict_step(lists, share, piece_scale=[sum(per_layer[a:b]) for a, b in bounds]).makespan
        if best is None or step < best[0]:
            best = (step, bounds)
    return best[1]
