"""F, B, W timed on a real stage with a clock the test controls, and the step the simulator predicts
from them against makespans worked out by hand."""

import itertools

import numpy as np
import pytest

from minidist.nn import GPT, GPTConfig
from minidist.parallel.pipeline.catalog import make_schedule
from minidist.parallel.pipeline.partition import (
    partition_balanced,
    partition_for,
    partition_uniform,
    partition_v,
)
from minidist.parallel.pipeline.stage import PipelineStage
from minidist.plan.pipeline_costs import Costs, busiest, cut_for_schedule, predict_step, stage_input, time_fbw

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


def test_the_simulated_cut_of_1f1b_over_many_microbatches_is_the_min_max_cut():
    """At m = 16 a 1F1B step is about m times its slowest stage: the cut the simulator prefers is the
    one the min-max dynamic programme finds (unique here: 1 2 3 | 1 1 2, slowest stage 6)."""
    costs = [1.0, 2.0, 3.0, 1.0, 1.0, 2.0]
    assert partition_balanced(costs, 2) == [(0, 3), (3, 6)]
    assert cut_for_schedule(costs, make_schedule("1f1b", 2, 16)) == [(0, 3), (3, 6)]


def test_the_simulated_cut_of_a_v_beats_the_uniform_one_and_balancing_the_ranks_alone():
    """Embedding, six blocks, head (a GPT's layer costs): the uniform V cut leaves rank 1 four blocks;
    the cut balancing the ranks' loads can give a rank one tiny piece and one huge one, which the
    V's fill and drain pay for. The simulator's cut is at least as fast as both, and faster than
    the uniform one."""
    costs = [0.03, 0.78, 0.75, 0.73, 0.75, 0.73, 0.73, 0.07]
    lists = make_schedule("zb_v", 2, 8)
    split = Costs(1.0, 1.0, 0.8)
    share = Costs(1 / 2.8, 1 / 2.8, 0.8 / 2.8)

    def step(bounds):
        return predict_step(lists, share, piece_scale=[sum(costs[a:b]) for a, b in bounds]).makespan
    chosen = cut_for_schedule(costs, lists, split)
    assert step(chosen) <= step(partition_v(costs, 2)) + 1e-12
    assert step(chosen) < step(partition_uniform(8, 4)) * 0.9
    assert cut_for_schedule(costs, lists, split, max_cuts=1) == partition_for(costs, lists.placement)


def test_the_simulated_cut_keeps_each_rank_within_the_memory_cap_and_refuses_what_cannot_be_cut():
    lists = make_schedule("zb_v", 2, 4)
    memory = [1, 1, 1, 1, 1, 5]  # the head's layer is heavy: rank 0 (pieces 0 and 3) holds it
    bounds = cut_for_schedule([1.0] * 6, lists, memory=memory, cap=6)
    rank0 = sum(sum(memory[a:b]) for a, b in (bounds[0], bounds[3]))
    assert rank0 <= 6 and sum(memory) - rank0 <= 6
    with pytest.raises(ValueError, match="memory cap 3"):
        cut_for_schedule([1.0] * 6, lists, memory=[5, 1, 1, 1, 1, 5], cap=3)
    with pytest.raises(ValueError, match="3 layers are too few"):
        cut_for_schedule([1.0] * 3, lists)
    with pytest.raises(ValueError, match="positive cost"):
        cut_for_schedule([1.0] * 4, lists, Costs(0, 0, 0))


@pytest.mark.parametrize("name, p, m, chunks, costs, opt, want", [
    # interleaved, v = 2: each chunk takes F/v = 0.5 forward and (B + W)/v = 0.5 backward; with forward
    # = backward the step is (v·m + p - 1) chunk-steps of 1: (8 + 1)·1 (priced as whole stages: 18)
    ("interleaved", 2, 4, 2, Costs(1, 0.5, 0.5), 0.0, 9.0),
    ("interleaved", 4, 8, 2, Costs(2, 1, 1), 0.25, (16 + 3) * 2 + 0.25),
    # ZB-V: each piece half a stage's F, B, W (F = B = W = 1): 3m + (p - 1)/2 = 12.5
    ("zb_v", 2, 4, 2, Costs(1, 1, 1), 0.0, 12.5),
    ("zb_v", 4, 8, 2, Costs(2, 2, 2), 0.0, 2 * (3 * 8 + 3 / 2)),
])
def test_predicted_step_with_more_than_one_chunk_per_rank_is_the_hand_makespan(name, p, m, chunks, costs, opt,
                                                                                want):
    lists = make_schedule(name, p, m, chunks)
    assert predict_step(lists, costs, chunks=chunks, opt_time=opt).makespan == pytest.approx(want)


def test_a_split_that_shares_nothing_is_refused_at_the_boundary():
    lists = make_schedule("1f1b", 2, 2)
    for split in (Costs(0, 0, 0), Costs(1, -1, 0), Costs(-1, 0, 0)):
        with pytest.raises(ValueError, match=r"split Costs\(.*\) must share a positive cost"):
            cut_for_schedule([1.0] * 4, lists, split)
    assert cut_for_schedule([1.0] * 4, lists, Costs(0, 0, 1e-9)) == [(0, 2), (2, 4)]


def test_time_fbw_leaves_out_the_warm_up_and_keeps_the_median():
    """Four runs (one warm-up + 3): the warm-up's F, B, W are 100x, the three timed ones (F, B, W) =
    (1, 2, 3), (5, 6, 7), (2, 3, 4) ms: the medians are (2, 3, 4) ms -- with the warm-up in they would be
    the mean of the middle two of four: (3.5, 4.5, 5.5)."""
    parts = [(0.1, 0.2, 0.3), (0.001, 0.002, 0.003), (0.005, 0.006, 0.007), (0.002, 0.003, 0.004)]
    ticks = itertools.accumulate([x for f, b, w in parts for x in (f, b, w, 0.0)], initial=0.0)
    model = GPT(CFG)
    stage = PipelineStage(model, partition_uniform(len(list(model)), 1), 0, 1)
    ids = np.zeros((1, 4), dtype=np.int64)
    got = time_fbw(stage, ids, ids, repeats=3, clock=lambda: next(ticks))
    assert (got.F, got.B, got.W) == pytest.approx((0.002, 0.003, 0.004))
