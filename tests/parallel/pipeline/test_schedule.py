"""Pipeline schedules as data: the simulator proves them deadlock-free and checks bubble and memory."""

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from minidist.parallel.pipeline.schedule import (
    Backward,
    Forward,
    OptimizerStep,
    RecvAct,
    RecvGrad,
    ScheduleError,
    SendAct,
    SendGrad,
    SendRecv,
    gpipe,
    interleaved_1f1b,
    interleaved_warmup,
    one_f_one_b,
    peer_of,
)
from minidist.parallel.pipeline.simulate import (
    DeadlockError,
    ascii_timeline,
    bubble_formula,
    simulate,
    validate,
)
from tests.conftest import budget

fast = budget(25)
stages = st.integers(1, 8)
microbatches = st.integers(1, 16)


def _order_checks(schedule, v=1):
    """Each stage: every (mb, chunk) forward once then backward once; first/last stage talk one way."""
    p = len(schedule)
    m = 1 + max(i.mb for ops in schedule for i in ops if isinstance(i, Forward))
    for s, ops in enumerate(schedule):
        fwd = [(i.mb, i.chunk) for i in ops if isinstance(i, Forward)]
        bwd = [(i.mb, i.chunk) for i in ops if isinstance(i, Backward)]
        assert sorted(fwd) == sorted(bwd) == [(mb, c) for mb in range(m) for c in range(v)]
        for key in fwd:
            assert ops.index(Forward(*key)) < ops.index(Backward(*key))
        assert ops[-1] == OptimizerStep()
        flat = [x for i in ops for x in (i.ops if isinstance(i, SendRecv) else (i,))]
        if v == 1 and s == 0:
            assert not any(isinstance(i, (RecvAct, SendGrad)) for i in flat)
        if v == 1 and s == p - 1:
            assert not any(isinstance(i, (SendAct, RecvGrad)) for i in flat)


@fast
@given(stages, microbatches, st.integers(1, 3), st.integers(1, 3))
@example(3, 4, 1, 2)
@example(5, 7, 1, 1)
@example(6, 2, 2, 1)
@example(7, 16, 1, 3)
def test_gpipe_and_1f1b_simulate_with_textbook_bubble_and_memory(p, m, f, b):
    for make in (gpipe, one_f_one_b):
        schedule = make(p, m)
        _order_checks(schedule)
        result = simulate(schedule, fwd_time=f, bwd_time=b)  # raises if it deadlocks
        assert result.makespan == (m + p - 1) * (f + b)
        assert result.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert simulate(gpipe(p, m)).peak_activations == [m] * p
    assert simulate(one_f_one_b(p, m)).peak_activations == [min(m, p - s) for s in range(p)]


@fast
@given(st.integers(2, 7), st.integers(1, 4), st.integers(1, 3))
@example(3, 2, 3)
@example(5, 1, 2)
@example(6, 2, 2)
@example(7, 2, 3)
def test_interleaved_1f1b_bubble_and_memory(p, groups, v):
    m = groups * p
    schedule = interleaved_1f1b(p, m, v)
    _order_checks(schedule, v)
    result = simulate(schedule, fwd_time=1.0, bwd_time=1.0)
    assert result.makespan == pytest.approx(2 * m * v + 2 * (p - 1) * 1.0)  # v·m fwd+bwd units + bubble
    assert result.bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    # Megatron-LM's warm-up, written out, plus the first steady-state forward
    want = [m * v if m == p else min((p - s - 1) * 2 + (v - 1) * p + 1, m * v) for s in range(p)]
    assert result.peak_activations == want
    simulate(schedule, fwd_time=1.0, bwd_time=2.0, comm_time=0.25)  # no deadlock with other costs either


# Hard-coded tables (not computed by the code under test). Per stage s:
#   warm-up  = forwards a stage runs before its first backward's slot (Megatron-LM's count for
#              interleaved: (p - s - 1) * 2 + (v - 1) * p, capped at m * v; all m * v when m == p),
#   in flight = most microbatches whose activations a stage holds at once (the peak memory).
# GPipe: all m forwards first, so m in flight. 1F1B: p - s - 1 warm-up forwards, then one more
# forward before the first backward: min(m, p - s) in flight.
GPIPE_IN_FLIGHT = {  # (p, m): per stage
    (1, 1): [1], (2, 3): [3, 3], (3, 5): [5, 5, 5], (4, 2): [2, 2, 2, 2], (5, 7): [7, 7, 7, 7, 7],
}
ONE_F_ONE_B_IN_FLIGHT = {  # (p, m): per stage
    (1, 1): [1], (2, 1): [1, 1], (2, 3): [2, 1], (3, 2): [2, 2, 1], (3, 5): [3, 2, 1],
    (4, 8): [4, 3, 2, 1], (5, 3): [3, 3, 3, 2, 1], (6, 6): [6, 5, 4, 3, 2, 1],
    (7, 4): [4, 4, 4, 4, 3, 2, 1],
}
INTERLEAVED = {  # (p, m, chunks): (warm-up per stage, in flight per stage)
    (2, 2, 2): ([4, 4], [4, 4]),                        # m == p: every forward first
    (2, 4, 2): ([4, 2], [5, 3]),
    (3, 3, 2): ([6, 6, 6], [6, 6, 6]),
    (3, 6, 1): ([4, 2, 0], [5, 3, 1]),
    (3, 6, 2): ([7, 5, 3], [8, 6, 4]),
    (3, 6, 3): ([10, 8, 6], [11, 9, 7]),
    (4, 4, 2): ([8, 8, 8, 8], [8, 8, 8, 8]),
    (4, 8, 2): ([10, 8, 6, 4], [11, 9, 7, 5]),
    (4, 8, 3): ([14, 12, 10, 8], [15, 13, 11, 9]),
    (4, 12, 2): ([10, 8, 6, 4], [11, 9, 7, 5]),
    (5, 10, 2): ([13, 11, 9, 7, 5], [14, 12, 10, 8, 6]),
}


def _forwards_before_first_backward(ops) -> int:
    compute = [i for i in ops if isinstance(i, (Forward, Backward))]
    return next(k for k, i in enumerate(compute) if isinstance(i, Backward))


@pytest.mark.parametrize("p,m", sorted(GPIPE_IN_FLIGHT))
def test_gpipe_in_flight_table(p, m):
    schedule = gpipe(p, m)
    assert [_forwards_before_first_backward(ops) for ops in schedule] == GPIPE_IN_FLIGHT[(p, m)]
    assert simulate(schedule).peak_activations == GPIPE_IN_FLIGHT[(p, m)]


@pytest.mark.parametrize("p,m", sorted(ONE_F_ONE_B_IN_FLIGHT))
def test_one_f_one_b_in_flight_table(p, m):
    schedule = one_f_one_b(p, m)
    assert [_forwards_before_first_backward(ops) for ops in schedule] == ONE_F_ONE_B_IN_FLIGHT[(p, m)]
    assert simulate(schedule).peak_activations == ONE_F_ONE_B_IN_FLIGHT[(p, m)]


@pytest.mark.parametrize("p,m,v", sorted(INTERLEAVED))
def test_interleaved_warmup_and_in_flight_table(p, m, v):
    warmup, in_flight = INTERLEAVED[(p, m, v)]
    assert [interleaved_warmup(p, m, v, s) for s in range(p)] == warmup
    schedule = interleaved_1f1b(p, m, v)
    assert [_forwards_before_first_backward(ops) for ops in schedule] == in_flight
    assert simulate(schedule, fwd_time=1.0, bwd_time=1.0).peak_activations == in_flight


def test_bubble_formula_textbook_values():
    assert bubble_formula(4, 8) == pytest.approx(3 / 11) and bubble_formula(1, 5) == 0.0
    assert bubble_formula(4, 8, 2) == pytest.approx(3 / 19)
    assert bubble_formula(2, 2, 3) == pytest.approx(1 / 7)


def test_interleaving_shrinks_the_bubble():
    assert simulate(interleaved_1f1b(4, 8, 2), 1, 1).bubble < simulate(one_f_one_b(4, 8), 1, 1).bubble


@pytest.mark.parametrize("p,m", [(2, 2), (3, 5), (4, 8)])
def test_sending_the_gradient_first_deadlocks(p, m):
    schedule = one_f_one_b(p, m)
    ops = schedule[1]
    k = next(k for k in range(len(ops) - 1)
             if isinstance(ops[k], RecvAct) and isinstance(ops[k + 1], SendGrad))
    ops[k], ops[k + 1] = ops[k + 1], ops[k]
    with pytest.raises(DeadlockError, match="stage 0 blocked at SendAct") as info:
        simulate(schedule)
    assert isinstance(info.value.blocked[1], SendGrad)


def test_comm_time_delays_the_pipeline():
    assert simulate(gpipe(3, 4), comm_time=0.5).makespan > simulate(gpipe(3, 4)).makespan


def test_peers_and_ring_of_interleaved():
    assert peer_of(SendAct(0), 1, 4) == 2 and peer_of(RecvGrad(0), 1, 4) == 2
    assert peer_of(SendGrad(0), 1, 4) == 0 and peer_of(RecvAct(0), 1, 4) == 0
    assert peer_of(SendAct(0, chunk=0), 3, 4) == 0  # last stage's chunk 0 feeds stage 0's chunk 1
    assert peer_of(RecvAct(0, chunk=1), 0, 4) == 3


@pytest.mark.parametrize("call,match", [
    (lambda: gpipe(0, 4), "num_stages must be an int >= 1"),
    (lambda: one_f_one_b(2, 0), "num_microbatches must be an int >= 1"),
    (lambda: interleaved_1f1b(4, 6, 2), "multiple of num_stages=4, got 6; use 4 or 8"),
    (lambda: interleaved_1f1b(1, 4, 2), "num_stages >= 2"),
    (lambda: interleaved_1f1b(2, 4, 0), "chunks must be"),
])
def test_bad_requests_raise_clear_errors(call, match):
    with pytest.raises(ScheduleError, match=match):
        call()


def test_validate_rejects_broken_schedules():
    with pytest.raises(ScheduleError, match="backward before the forward"):
        validate([[Backward(0), Forward(0)]])
    with pytest.raises(ScheduleError, match="needs an earlier RecvAct"):
        validate([[Forward(0), SendAct(0), RecvGrad(0), Backward(0)], [Forward(0), Backward(0), SendGrad(0)]])
    with pytest.raises(ScheduleError, match="no Backward"):
        validate([[Forward(0), Forward(1), Backward(0)]])
    with pytest.raises(ScheduleError, match="no virtual stage 1"):
        validate([[Forward(0), SendAct(0), Backward(0)]])
    with pytest.raises(ScheduleError, match=r"sends before its Forward\(mb=0, chunk=0\)"):
        validate([[SendAct(0), Forward(0), RecvGrad(0), Backward(0)], [RecvAct(0), Forward(0), Backward(0)]])
    with pytest.raises(ScheduleError, match="runs twice"):
        validate([[Forward(0), Forward(0), Backward(0)]])


@fast
@given(stages, microbatches)
def test_ascii_timeline_has_one_row_per_stage(p, m):
    text = ascii_timeline(simulate(one_f_one_b(p, m)), width=80)
    rows = text.splitlines()
    assert len(rows) == p
    assert all(row.startswith(f"stage {s}") for s, row in enumerate(rows))
    assert len({len(row) for row in rows}) == 1
    assert rows[0].split("|")[1].startswith("F")
    assert "B" in rows[-1]


def test_ascii_timeline_shows_microbatch_digits_and_the_bubble():
    rows = ascii_timeline(simulate(gpipe(2, 2), fwd_time=1, bwd_time=2), width=27).splitlines()
    assert rows[0] == "stage 0 |F0fF1f.........B0bbbbB1bbbb|"
    assert rows[1] == "stage 1 |...F0fF1fB0bbbbB1bbbb......|"


def test_piece_scale_stretches_one_piece_as_worked_by_hand():
    """GPipe, 2 stages, 1 microbatch, F 1, B 2, piece 1 three times as heavy: F0 0..1, F1 1..4,
    B1 4..10, B0 10..12."""
    assert simulate(gpipe(2, 1)).makespan == 1 + 1 + 2 + 2  # F0, F1, B1, B0
    assert simulate(gpipe(2, 1), piece_scale=[1, 3]).makespan == 12


def test_piece_scale_reaches_the_v_pieces_by_placement():
    """A V's rank 0 holds pieces 0 and 3 and rank 1 pieces 1 and 2 (placement written out here):
    each compute span lasts its piece's number times its kind's cost."""
    from minidist.parallel.pipeline.catalog import make_schedule

    sched = make_schedule("zb_v", 2, 4)
    piece = {(0, 0): 0, (1, 0): 1, (1, 1): 2, (0, 1): 3}
    scale = [1.0, 2.0, 3.0, 5.0]
    kind = {"Forward": 1.0, "BackwardInput": 0.5, "BackwardWeight": 0.25}
    res = simulate(sched, fwd_time=1.0, input_time=0.5, weight_time=0.25, piece_scale=scale)
    spans = [e for e in res.events if e["name"] in kind]
    assert len(spans) == 3 * 4 * 4  # F, B, W of 4 microbatches through 4 pieces
    for e in spans:
        want = kind[e["name"]] * scale[piece[e["rank"], e["args"]["chunk"]]]
        assert e["t1"] - e["t0"] == pytest.approx(want)
    assert simulate(sched, 1.0, input_time=0.5, weight_time=0.25, piece_scale=[1] * 4).makespan == \
        simulate(sched, 1.0, input_time=0.5, weight_time=0.25).makespan


def test_piece_scale_needs_one_number_a_piece():
    with pytest.raises(ValueError, match="4 pieces"):
        simulate(interleaved_1f1b(2, 4, 2), piece_scale=[1, 1])
