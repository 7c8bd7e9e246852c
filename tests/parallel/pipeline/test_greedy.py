"""The greedy list scheduler and the unit-step makespan (minidist/parallel/pipeline/greedy.py) on their
own, against orders and step counts worked out by hand."""

import pytest

from minidist.parallel.pipeline.greedy import greedy_order, unit_makespan
from minidist.parallel.pipeline.placement import looped
from minidist.parallel.pipeline.schedule import (
    COMPUTE,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    ScheduleError,
    one_f_one_b,
)
from tests.parallel.pipeline.test_zero_bubble import _held_to_w  # most microbatches between F and W

F, B, W = Forward, BackwardInput, BackwardWeight


def test_greedy_order_with_a_memory_cap_of_two_by_hand():
    """p = 2, m = 4, no in-flight limit, at most 2 microbatches between F and W on a rank. In unit steps:
    t0 r0 F0; t1 r0 F1, r1 F0; t2 r0 idle (cap reached, no B, no W), r1 B0; t3 r0 B0, r1 F1; t4 r0 W0
    (frees one), r1 B1; t5 r0 B1, r1 W0; t6 r0 F2, r1 W1; t7 r0 W1, r1 F2; t8 r0 F3, r1 B2; t9 r0 B2,
    r1 F3; t10 r0 W2, r1 B3; t11 r0 B3, r1 W2; t12 both W3."""
    order = greedy_order(looped(2), 4, lambda s, c: 4, held=2)
    assert order[0] == [F(0), F(1), B(0), W(0), B(1), F(2), W(1), F(3), B(2), W(2), B(3), W(3)]
    assert order[1] == [F(0), B(0), F(1), B(1), W(0), W(1), F(2), B(2), F(3), B(3), W(2), W(3)]
    assert all(_held_to_w(ops) <= 2 for ops in order)
    assert unit_makespan(order, looped(2)) == 13


def test_greedy_order_obeys_the_in_flight_limit():
    """In flight 1 (between F and B), no memory cap: a rank never runs two forwards before a B."""
    order = greedy_order(looped(3), 4, lambda s, c: 1, held=100)
    for ops in order:
        held = 0
        for op in ops:
            held += isinstance(op, Forward) - isinstance(op, BackwardInput)
            assert held <= 1
        assert sorted(op.mb for op in ops if isinstance(op, W)) == [0, 1, 2, 3]


def test_greedy_order_refuses_limits_that_starve_it():
    with pytest.raises(ScheduleError, match="starves with these in-flight limits and held=0 .*p=2, m=3"):
        greedy_order(looped(2), 3, lambda s, c: 2, held=0)


def test_unit_makespan_of_1f1b_counts_a_whole_backward_as_two_steps():
    """1F1B, p = 2, m = 2, F = 1 and a whole Backward 2: (m + p - 1)(F + B) = 9 steps."""
    order = [[i for i in ops if isinstance(i, COMPUTE)] for ops in one_f_one_b(2, 2)]
    assert any(isinstance(i, Backward) for i in order[0])
    assert unit_makespan(order, looped(2)) == 9
    # a single stage runs back to back: 2 forwards + 2 whole backwards = 6
    assert unit_makespan([[F(0), F(1), Backward(0), Backward(1)]], looped(1)) == 6


def test_unit_makespan_refuses_an_order_that_deadlocks():
    """Stage 1 starts with microbatch 1, which stage 0 forwards only after microbatch 0's B, which needs
    stage 1's: neither moves."""
    order = [[F(0), B(0), F(1), B(1)], [F(1), B(1), F(0), B(0)]]
    with pytest.raises(ScheduleError, match="the order deadlocks"):
        unit_makespan(order, looped(2))
