"""F, B, W timed on a real stage with a clock the test controls, and the step the simulator predicts
from them against makespans worked out by hand."""

import itertools

import numpy as np
import pytest

from minidist.nn import GPT, GPTConfig
from minidist.parallel.pipeline.runtime import PipelineStage, make_schedule, partition_uniform
from minidist.plan.pipeline_costs import Costs, busiest, predict_step, stage_input, time_fbw

CFG = GPTConfig(vocab_size=16, block_size=4, n_layer=2, n_head=2, d_model=8)


def _clock(F, B, W):
    """Each repeat reads the clock 4 times: start, after F, after B, after W."""
    ticks = itertools.accumulate(itertools.cycle([F, B, W, 0.0]), initial=0.0)
    return lambda: next(ticks)


@pytest.mark.parametrize("stage_index", [0, 1])
def test_time_fbw_reads_each_part_and_leaves_no_gradients(stage_index):
    model = GPT(CFG)
    bounds = partition_uniform(len(list(model)), 2)
    stage = PipelineStage(model, bounds, stage_index, 2)
    ids = np.random.default_rng(0).integers(0, 16, (2, 4))
    x = stage_input(model, bounds[stage_index][0], ids)
    got = time_fbw(stage, x, ids, repeats=3, clock=_clock(0.004, 0.003, 0.002))
    assert (got.F, got.B, got.W) == pytest.approx((0.004, 0.003, 0.002))
    assert all(p.grad is None for p in stage.parameters())


def test_time_fbw_runs_the_weight_gradients_in_w():
    """A clock that records what has happened: W is where the parameters get their gradients."""
    model = GPT(CFG)
    stage = PipelineStage(model, partition_uniform(len(list(model)), 1), 0, 1)
    ids = np.zeros((1, 4), dtype=np.int64)
    seen = []

    def clock():
        seen.append(sum(p.grad is not None for p in stage.parameters()))
        return float(len(seen))
    time_fbw(stage, ids, ids, repeats=1, clock=clock)
    assert seen[:3] == [0, 0, 0] and seen[3] == len(stage.parameters())  # after W: every parameter


@pytest.mark.parametrize("name, costs, opt, want", [
    ("1f1b", Costs(1, 2, 0), 0.5, 3 * 3 + 0.5),   # (m+p-1)(F+B+W), p = 2, m = 2, + the update
    ("gpipe", Costs(1, 2, 0), 0.0, 5 * 3),        # p = 2, m = 4: (4+1) x 3
    ("zb_h1", Costs(1, 1, 1), 0.0, 3 * 4 + 1),    # p = 2, m = 4, F = B = W: 3m + p - 1
    ("1f1b", Costs(1, 1.5, 0.5), 0.0, 11 * 3),    # p = 4, m = 8: (8+3)(1+2), B + W as one backward
])
def test_predicted_step_is_the_hand_makespan(name, costs, opt, want):
    p, m = (4, 8) if costs.B == 1.5 else (2, 2 if name == "1f1b" else 4)
    assert predict_step(make_schedule(name, p, m), costs, opt_time=opt).makespan == pytest.approx(want)


def test_the_busiest_stage_is_the_one_with_most_work():
    assert busiest([Costs(3, 1, 1), Costs(1, 2, 3)]) == Costs(1, 2, 3)
