"""Pipeline re-partitioning: the min-max cut against a brute force, and training re-cut while it runs
== the serial twin (decisions checked against the measured costs on the real clock, the exact re-cut
on a virtual clock). The step time, when a move pays: ``test_repartition.py``; profiling:
``test_profile.py``."""

import math

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from minidist.comm import run
from minidist.nn.serial import max_state_diff, train_serial
from minidist.parallel.balance.pipeline import gather_stage_states, train_pipeline_balanced
from minidist.parallel.pipeline.partition import partition_balanced
from minidist.resilience.stragglers import Slowdown
from tests.conftest import budget
from tests.parallel.balance.helpers import PCFG, TOL, best_cut, make_batches, virtual_clock

# -- the partition -------------------------------------------------------------------------------


@given(costs=st.lists(st.integers(1, 20), min_size=1, max_size=8), p=st.integers(1, 4), data=st.data())
def test_min_max_partition_is_optimal_against_brute_force_within_the_memory_cap(costs, p, data):
    if p > len(costs):
        return
    memory = data.draw(st.lists(st.integers(1, 9), min_size=len(costs), max_size=len(costs)))
    cap = data.draw(st.integers(max(memory), sum(memory)))
    for mem, c in [(None, None), (memory, cap)]:
        want = best_cut(costs, p, mem, c)
        if want == math.inf:
            with pytest.raises(ValueError, match="memory"):
                partition_balanced(costs, p, mem, c)
            continue
        bounds = partition_balanced(costs, p, mem, c)
        assert bounds[0][0] == 0 and bounds[-1][1] == len(costs) and len(bounds) == p
        assert all(a < b for a, b in bounds) and all(b == a2 for (_, b), (a2, _) in zip(bounds, bounds[1:]))
        assert max(sum(costs[a:b]) for a, b in bounds) == want
        if mem is not None:
            assert all(sum(mem[a:b]) <= c for a, b in bounds)


# -- the pipeline re-partitioned while training == serial -----------------------------------------


@budget(4)
@given(data=st.data(), optimizer=st.sampled_from(["sgd", "adamw"]))
@example(data=None, optimizer="adamw")
def test_pipeline_equals_serial_across_random_repartitions(data, optimizer):
    p, n, steps = 3, 6, 4
    batches = make_batches(4, steps, seed=3)
    plans = {}
    for step in range(steps - 1):
        if data is None:  # the example: every layer moves at least once
            plans = {0: [(0, 1), (1, 2), (2, 6)], 1: [(0, 4), (4, 5), (5, 6)]}
            break
        if data.draw(st.booleans()):
            cuts = sorted(data.draw(st.lists(st.integers(1, n - 1), min_size=p - 1, max_size=p - 1,
                                             unique=True)))
            edges = [0, *cuts, n]
            plans[step] = list(zip(edges[:-1], edges[1:]))
    want, want_losses = train_serial(PCFG, batches, lr=0.1, optimizer=optimizer)

    def body(comm):
        r = train_pipeline_balanced(comm, PCFG, batches, microbatches=2, optimizer=optimizer, slow=None,
                                    plan=plans.get)
        return gather_stage_states(comm, r), r.losses, r.bounds
    results = run(body, ranks=p)
    state, losses, bounds = results[0]
    assert max_state_diff(state, want) <= TOL
    np.testing.assert_allclose(losses, want_losses, rtol=0, atol=TOL)
    for step, b in plans.items():
        assert bounds[step + 1] == [tuple(x) for x in b]


def _train_with_heavy_layers(monkeypatch=None):
    """Layers 2 and 3 (blocks 1 and 2) become 4x heavier at step 1, on a 3-stage pipeline of 6 layers,
    6 steps of 4 microbatches (1 row each); re-decided after steps 1 and 3 from the last step's costs."""
    from minidist.parallel.balance import pipeline, profile

    if monkeypatch is not None:
        virtual_clock(monkeypatch, pipeline, profile)
    batches = make_batches(4, 6, seed=4)
    slow = Slowdown("layer=2,factor=4,from_step=1;layer=3,factor=4,from_step=1", pace=0.0015)

    def body(comm):
        r = train_pipeline_balanced(comm, PCFG, batches, microbatches=4, optimizer="adamw", slow=slow,
                                    every=2, window=1)
        return gather_stage_states(comm, r), r.bounds, r.moves, r.layer_seconds
    return batches, run(body, ranks=3)


def _one_step(total, slowest, m=4):
    """A step of m identical microbatches through stages costing ``total`` together, the slowest
    ``slowest`` (the flow shop's makespan): the first microbatch crosses every stage, the other m - 1
    follow at the slowest stage's pace. Every cut has the same total, so the best step is the cut with
    the smallest slowest stage."""
    return total / m + (m - 1) / m * slowest


def test_pipeline_repartitions_as_its_measured_costs_say_and_still_equals_serial():
    """On the real clock, whatever the load: training equals the serial twin, and after steps 1 and 3
    the cut moves iff the best contiguous cut of the costs measured that step (window 1) predicts a
    step more than 10% shorter, to a cut as good as the brute force's (moving a few kB at the default
    1 GB/s always pays for itself here)."""
    batches, results = _train_with_heavy_layers()
    want, _ = train_serial(PCFG, batches, lr=0.1, optimizer="adamw")
    state, bounds, moves, costs = results[0]
    assert max_state_diff(state, want) <= TOL
    assert all(r[1] == bounds and r[3] == costs for r in results)  # the same decisions on every stage
    assert bounds[0] == [(0, 2), (2, 4), (4, 6)]
    for step in range(len(bounds) - 1):
        before, after = bounds[step], bounds[step + 1]
        if step not in (1, 3):
            assert after == before, (step, bounds)
            continue
        c = costs[step]
        now = _one_step(sum(c), max(sum(c[a:b]) for a, b in before))
        best = _one_step(sum(c), best_cut(c, 3))
        assert (after != before) == (best < 0.9 * now), (step, before, after, c)
        if after != before:
            assert max(sum(c[a:b]) for a, b in after) == pytest.approx(best_cut(c, 3)), (after, c)
    assert [m[0] for m in moves] == [s for s in range(len(bounds) - 1) if bounds[s + 1] != bounds[s]]


def test_heavy_layers_are_separated_on_avirtual_clock(monkeypatch):
    """Exact costs: a layer's forward lasts 1 row x 1.5 ms x its factor per microbatch and its backward
    twice that, so a step's cost per layer is 4 x 3 x 1.5 ms x (1, 1, 4, 4, 1, 1) from step 1 on. The
    uniform cut's stages cost (2, 8, 2) units c, a step 12c/4 + 3/4 8c = 9c; the best cut's slowest
    stage is 6c (2 and 3 apart: together they are 8c), 7.5c < 0.9 x 9c, so it moves once, after step
    1, and never again."""
    batches, results = _train_with_heavy_layers(monkeypatch)
    want, _ = train_serial(PCFG, batches, lr=0.1, optimizer="adamw")
    unit = 4 * 3 * 0.0015
    assert max_state_diff(results[0][0], want) <= TOL  # (gathered on stage 0)
    for _, bounds, moves, costs in results:
        np.testing.assert_allclose(costs[0], [unit] * 6)
        np.testing.assert_allclose(costs[1:], [[unit * f for f in (1, 1, 4, 4, 1, 1)]] * 5)
        assert bounds[:2] == [[(0, 2), (2, 4), (4, 6)]] * 2 and [m[0] for m in moves] == [1]
        final = bounds[2]
        assert bounds[2:] == [final] * 4 and max(sum((1, 1, 4, 4, 1, 1)[a:b]) for a, b in final) == 6
        stage_of = {i: s for s, (a, b) in enumerate(final) for i in range(a, b)}
        assert stage_of[2] != stage_of[3], final


