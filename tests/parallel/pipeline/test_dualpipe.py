"""DualPipeV: dualpipev.py's order, deadlock-free, its bubble formula exactly, equal to the serial model."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist.parallel.pipeline.dualpipe import dualpipe_v, dualpipe_v_bubble_formula
from minidist.parallel.pipeline.schedule import (
    COMPUTE,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    ScheduleError,
    one_f_one_b,
)
from minidist.parallel.pipeline.simulate import simulate
from tests.conftest import budget

HALF = dict(fwd_time=0.5, bwd_time=1.0, input_time=0.5, weight_time=0.5)  # per piece; a stage forward is 1
F, Bk, BI, W = Forward, Backward, BackwardInput, BackwardWeight

# p = 2, m = 4, worked by hand through dualpipev.py's `step` (phases 1..8, chunk counters, W FIFO).
# rank 0: nF0 x2; nF0F1 x1; nB1W1F1 x1; main x1 (F0&B1, F1&B0); nB1F1B0 x1; nB1B0 (B0 split); nWB0; nW
RANK0 = [F(0, 0), F(1, 0), F(2, 0), F(0, 1), BI(0, 1), W(0, 1), F(1, 1), F(3, 0), Bk(1, 1), F(2, 1), Bk(0, 0),
         Bk(2, 1), F(3, 1), Bk(1, 0), Bk(3, 1), BI(2, 0), W(2, 0), BI(3, 0), W(3, 0)]
# rank 1 (the turn): nF0F1 x2; main x2, the first F0 and B1 not paired; nB1B0 x2, the second split; nW x2
RANK1 = [F(0, 0), F(0, 1), F(1, 0), F(1, 1), F(2, 0), Bk(0, 1), F(2, 1), Bk(0, 0), F(3, 0), Bk(1, 1),
         F(3, 1), Bk(1, 0), Bk(2, 1), Bk(2, 0), BI(3, 1), BI(3, 0), W(3, 1), W(3, 0)]


def test_order_is_dualpipev_step_by_hand():
    sched = dualpipe_v(2, 4)
    assert [i for i in sched[0] if isinstance(i, COMPUTE)] == RANK0
    assert [i for i in sched[1] if isinstance(i, COMPUTE)] == RANK1
    ops = sched[0]
    k = ops.index(F(3, 0))
    assert ops[k + 1] == Bk(1, 1)  # an F&B slot: no communication between its forward and backward


@pytest.mark.parametrize("p", range(2, 9))
def test_deadlock_free_bubble_is_the_formula_memory_2p_plus_1(p):
    """(PP/2 - 1)(F&B + B - 3W) with PP = 2p pieces, F = W = 1/2, B = 1, F&B = F + B (no compute
    overlap): (p-1) stage-forwards of idle per rank, fraction (p-1)/(3m+p-1); activations 2p + 1 pieces
    (the README's PP + 1) on every rank, 1F1B's p stages plus half of one."""
    for m in list(range(2 * p, 2 * p + 4)) + [24]:
        r = simulate(dualpipe_v(p, m), buffered_sends=True, **HALF)
        assert r.bubble == pytest.approx(dualpipe_v_bubble_formula(p, m))
        assert r.bubble == pytest.approx((p - 1) / (3 * m + p - 1))
        assert r.makespan == 3 * m + p - 1
        assert r.peak_activations == [2 * p + 1] * p
        assert r.bubble < simulate(one_f_one_b(p, m), 1, 2).bubble


def test_overlap_would_shrink_the_bubble():
    """A real F&B slot (two streams) costs less than F + B: the formula's bubble falls with it."""
    assert dualpipe_v_bubble_formula(4, 8) == pytest.approx(3 / 27)
    assert dualpipe_v_bubble_formula(4, 8, overlap=0.5) < dualpipe_v_bubble_formula(4, 8)


def test_fewer_than_2p_microbatches_is_refused():
    with pytest.raises(ScheduleError, match="dualpipe_v needs num_microbatches >= 8 for num_stages=4, got 7"):
        dualpipe_v(4, 7)


@given(p=st.integers(2, 3), extra=st.integers(0, 2), more=st.integers(0, 2), seed=st.integers(0, 99))
@budget(6, deadline=None)
def test_on_threads_equals_the_serial_model(step_vs_serial, p, extra, more, seed):
    stats, diff, dloss = step_vs_serial("dualpipe-v", p, 2 * p + extra, 2 * p - 2 + more, seed)
    assert diff <= 1e-12 and dloss <= 1e-12
    assert stats[0].loss is not None
