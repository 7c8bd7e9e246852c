"""DualPipeV (dualpipev.py's order, its messages uncoupled) and full two-copy DualPipe (dualpipe.py's
order on a dual placement): hand-worked orders, deadlock freedom, DeepSeek's bubble formula, memory,
and training on threads equal to the serial model with both copies' gradients summed."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist.comm import run
from minidist.nn import GPT
from minidist.parallel.pipeline.catalog import make_schedule
from minidist.parallel.pipeline.dualpipe import (
    dualpipe,
    dualpipe_bubble_formula,
    dualpipe_slots,
    dualpipe_v,
    dualpipe_v_bubble_formula,
    dualpipe_v_slots,
)
from minidist.parallel.pipeline.greedy import unit_makespan
from minidist.parallel.pipeline.instructions import with_messages
from minidist.parallel.pipeline.partition import partition_uniform
from minidist.parallel.pipeline.placement import Schedule, dual, v_shape
from minidist.parallel.pipeline.runtime import run_schedule, split_microbatches
from minidist.parallel.pipeline.schedule import (
    COMPUTE,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    OptimizerStep,
    RecvAct,
    RecvGrad,
    ScheduleError,
    SendAct,
    SendGrad,
    SendRecv,
    one_f_one_b,
)
from minidist.parallel.pipeline.simulate import DeadlockError, simulate
from minidist.parallel.pipeline.stage import PipelineStage
from tests.conftest import budget
from tests.parallel.pipeline.conftest import TINY, serial_step

HALF = dict(fwd_time=0.5, bwd_time=1.0, input_time=0.5, weight_time=0.5)  # per piece; a stage forward is 1
UNIT = dict(fwd_time=1, bwd_time=2, input_time=1, weight_time=1)
F, Bk, BI, W = Forward, Backward, BackwardInput, BackwardWeight

# p = 2, m = 4, worked by hand through dualpipev.py's `step` (phases 1..8, chunk counters, W FIFO).
# rank 0: nF0 x2; nF0F1 x1; nB1W1F1 x1; main x1 (F0&B1, F1&B0); nB1F1B0 x1; nB1B0 (B0 split); nWB0; nW
RANK0 = [F(0, 0), F(1, 0), F(2, 0), F(0, 1), BI(0, 1), W(0, 1), F(1, 1), F(3, 0), Bk(1, 1), F(2, 1), Bk(0, 0),
         Bk(2, 1), F(3, 1), Bk(1, 0), Bk(3, 1), BI(2, 0), W(2, 0), BI(3, 0), W(3, 0)]
# rank 1 (the turn): nF0F1 x2; main x2, the first F0 and B1 not paired; nB1B0 x2, the second split; nW x2
RANK1 = [F(0, 0), F(0, 1), F(1, 0), F(1, 1), F(2, 0), Bk(0, 1), F(2, 1), Bk(0, 0), F(3, 0), Bk(1, 1),
         F(3, 1), Bk(1, 0), Bk(2, 1), Bk(2, 0), BI(3, 1), BI(3, 0), W(3, 1), W(3, 0)]

# full DualPipe, p = 2, m = 4, by hand through dualpipe.py's `step` (half_rank 0 of 1, 2 microbatches a
# direction): microbatches 0, 1 enter at rank 0 through copy 0 (chunk 0), 2, 3 at rank 1 through copy
# 1 (chunk 1). Rank 0: nF0F1 x1; main x1 (the middle rank: F0 and B1 apart, then F1&B0); nB1B0 x1, B0
# split; nW.
DUAL0 = [F(0, 0), F(2, 1), F(1, 0), Bk(2, 1), F(3, 1), Bk(0, 0), Bk(3, 1), BI(1, 0), W(1, 0)]
# rank 1 runs the same phases with its own direction (copy 1) as its "phase 0"
DUAL1 = [F(2, 1), F(0, 0), F(3, 1), Bk(0, 0), F(1, 0), Bk(2, 1), Bk(1, 0), BI(3, 1), W(3, 1)]


def _compute(ops):
    return [i for i in ops if isinstance(i, COMPUTE)]


def _coupled(slots, placement):
    """The same slots with DeepSeek's messages: both receives of an F&B slot posted before it."""
    return Schedule([with_messages(sl, s, placement) + [OptimizerStep()] for s, sl in enumerate(slots)],
                    placement, buffered_sends=True)


# -- DualPipeV --------------------------------------------------------------------------------------

def test_order_is_dualpipev_step_by_hand():
    sched = dualpipe_v(2, 4)
    assert [_compute(ops) for ops in sched] == [RANK0, RANK1]


def test_no_receive_is_coupled_to_the_other_chunks_compute():
    """Rank 1's F&B slot F(3, 0) & B(1, 1): only the forward's input is waited for before the forward
    (with the previous backward's send); the backward's gradient after it, with the forward's send."""
    ops = dualpipe_v(2, 4)[1]
    k = ops.index(F(3, 0))
    assert ops[k - 1] == SendRecv((SendGrad(0, 0), RecvAct(3, 0)))
    assert ops[k + 1] == SendRecv((SendAct(3, 0), RecvGrad(1, 1))) and ops[k + 2] == Bk(1, 1)


@pytest.mark.parametrize("p", range(2, 9))
def test_v_deadlock_free_at_the_uncoupled_orders_step_memory_2p_plus_1(p):
    """The step is exactly what its compute order allows (`unit_makespan`, free messages): 3m + (p-1)/2,
    ZB-V's floor; DeepSeek's posting (both receives before an F&B slot) waits for the later of the two:
    (PP/2 - 1)(F&B + B - 3W) with PP = 2p pieces, F = W = 1/2, B = 1, F&B = F + B, i.e. p - 1 stage
    forwards per rank. Activations 2p + 1 pieces on every rank (the README's PP + 1)."""
    for m in [*range(2 * p, 2 * p + 4), 24]:
        r = simulate(dualpipe_v(p, m), **HALF)
        order = [_compute(ops) for ops in dualpipe_v(p, m)]
        assert r.makespan == unit_makespan(order, v_shape(p)) / 2 == 3 * m + (p - 1) / 2
        coupled = simulate(_coupled(dualpipe_v_slots(p, m), v_shape(p)), **HALF)
        assert coupled.makespan == 3 * m + p - 1
        assert coupled.bubble == pytest.approx(dualpipe_v_bubble_formula(p, m))
        assert r.peak_activations == [2 * p + 1] * p
        assert r.bubble < simulate(one_f_one_b(p, m), 1, 2).bubble


def test_p8_m16_is_the_uncoupled_orders_step():
    """The issue's number: 55 with both receives posted before each F&B slot, 51.5 now."""
    assert simulate(dualpipe_v(8, 16), **HALF).makespan == 51.5
    assert simulate(_coupled(dualpipe_v_slots(8, 16), v_shape(8)), **HALF).makespan == 55


def test_overlap_would_shrink_the_bubble():
    assert dualpipe_v_bubble_formula(4, 8) == pytest.approx(3 / 27)
    assert dualpipe_v_bubble_formula(4, 8, overlap=0.5) < dualpipe_v_bubble_formula(4, 8)


def test_fewer_than_2p_microbatches_is_refused():
    with pytest.raises(ScheduleError, match="dualpipe_v needs num_microbatches >= 8 for num_stages=4, got 7"):
        dualpipe_v(4, 7)


@given(p=st.integers(2, 3), extra=st.integers(0, 2), more=st.integers(0, 2), seed=st.integers(0, 99))
@budget(6, deadline=None)
def test_v_on_threads_equals_the_serial_model(step_vs_serial, p, extra, more, seed):
    stats, diff, dloss = step_vs_serial("dualpipe-v", p, 2 * p + extra, 2 * p - 2 + more, seed)
    assert diff <= 1e-12 and dloss <= 1e-12
    assert stats[0].loss is not None


# -- full DualPipe: two copies ------------------------------------------------------------------------

def test_dual_order_by_hand():
    assert [_compute(ops) for ops in dualpipe(2, 4)] == [DUAL0, DUAL1]


def test_dual_placement_by_hand():
    """p = 4: rank s holds copy 0's piece s (chunk 0) and copy 1's piece 3 - s (chunk 1); copy 1's
    messages run the other way round the ranks."""
    d = dual(4)
    assert [[d.virtual_stage(s, c) for c in (0, 1)] for s in range(4)] == [[0, 3], [1, 2], [2, 1], [3, 0]]
    assert d.num_virtual == 4 and d.copies == 2
    assert [d.rank_of(vs, 0) for vs in range(4)] == [0, 1, 2, 3]
    assert [d.rank_of(vs, 1) for vs in range(4)] == [3, 2, 1, 0]
    with pytest.raises(ValueError, match="even number of ranks"):
        dual(3)


@pytest.mark.parametrize("p", [2, 4, 6, 8])
def test_dual_deadlock_free_bubble_against_deepseeks_formula_memory(p):
    """Per piece F = B = W = 1 (a full backward B + W = 2). DeepSeek's posting (both receives before
    an F&B slot): each rank idles (p/2 - 1)(F&B + B - 3W), F&B = F + B (no overlap on CPU ranks), B the
    full backward -- exactly. minidist's, each receive before its own op: half of it, (p/2 - 1)(F + B -
    W) with B the input half, DeepSeek's formula at an overlap of a third. Every rank holds p + 1
    pieces' activations (DeepSeek's PP + 1), at twice the parameters."""
    for m in (2 * p, 2 * p + 2, 4 * p):
        r = simulate(dualpipe(p, m), **UNIT)
        coupled = simulate(_coupled(dualpipe_slots(p, m), dual(p)), **UNIT)
        assert coupled.makespan - 3 * m == (p / 2 - 1) * ((1 + 2) + 2 - 3 * 1)
        assert coupled.bubble == pytest.approx(dualpipe_bubble_formula(p, m))
        assert r.makespan - 3 * m == (p / 2 - 1) * (1 + 1 - 1)
        assert r.bubble == pytest.approx(dualpipe_bubble_formula(p, m, overlap=1 / 3))
        assert r.peak_activations == [p + 1] * p
        order = [_compute(ops) for ops in dualpipe(p, m)]
        assert r.makespan == unit_makespan(order, dual(p))


@pytest.mark.parametrize("f,b,w", [(1, 1, 0.5), (1.5, 1, 0.5), (2, 1, 1), (1, 0.6, 0.4)])
def test_dual_unequal_costs(f, b, w):
    """With B = F (DeepSeek's F&B cells) DeepSeek's formula still holds exactly for its posting; with
    F >= B >= W minidist's order idles (p/2 - 1)(F + B - W), never more than DeepSeek's posting."""
    for p in (4, 6, 8):
        m = 2 * p + 2
        kw = dict(fwd_time=f, bwd_time=b + w, input_time=b, weight_time=w)
        ours = simulate(dualpipe(p, m), **kw).makespan - m * (f + b + w)
        theirs = simulate(_coupled(dualpipe_slots(p, m), dual(p)), **kw).makespan - m * (f + b + w)
        assert ours == pytest.approx((p / 2 - 1) * (f + b - w))
        if f == b:
            assert theirs == pytest.approx((p / 2 - 1) * ((f + b + w) + (b + w) - 3 * w))
        assert ours <= theirs + 1e-9


def test_dual_needs_even_sizes_and_2p_microbatches():
    with pytest.raises(ScheduleError, match="dualpipe needs an even num_stages and num_microbatches"):
        dualpipe(3, 6)
    with pytest.raises(ScheduleError, match="even num_stages and num_microbatches .* got 4 and 9"):
        dualpipe(4, 9)
    with pytest.raises(ScheduleError, match="dualpipe needs num_microbatches >= 8 for num_stages=4, got 6"):
        dualpipe(4, 6)
    simulate(dualpipe(4, 8))
    with pytest.raises(DeadlockError):  # made for background sends, as DualPipe's batched isend/irecv
        simulate(dualpipe(4, 8), buffered_sends=False)


def test_dual_holds_twice_the_parameters():
    model = GPT(TINY.replace(n_layer=2))
    sched = make_schedule("dualpipe", 2, 4)
    bounds = partition_uniform(len(model), sched.placement.num_virtual)
    stages = [PipelineStage(model, bounds, s, 2, placement=sched.placement) for s in range(2)]
    held = sum(p.data.size for st in stages for p in st.parameters())
    assert held == 2 * sum(p.data.size for p in model.parameters())


def _dual_rank(comm, m, x, y, cfg):
    model = GPT(cfg)
    sched = make_schedule("dualpipe", comm.size, m)
    bounds = partition_uniform(len(model), sched.placement.num_virtual)
    stage = PipelineStage(model, bounds, comm.rank, comm.size, placement=sched.placement)
    stats = run_schedule(stage, comm, sched[comm.rank], split_microbatches(x, m), split_microbatches(y, m))
    return stats, [{n: p.grad for i in ids for n, p in model[i].named_parameters(prefix=f"{i}.")}
                   for ids in stage.layer_ids]


@given(half=st.integers(1, 2), extra=st.integers(0, 2), more=st.integers(0, 2), seed=st.integers(0, 99))
@budget(6, deadline=None)
def test_dual_on_threads_equals_the_serial_model_both_copies_alike(half, extra, more, seed):
    """Both end ranks report the batch's loss; each piece's two copies (rank s's chunk 0, rank p-1-s's
    chunk 1) hold bit-identical gradients, the serial model's to rounding."""
    p, m = 2 * half, 2 * (2 * half + extra)
    cfg = TINY.replace(n_layer=max(p - 2, 1) + more)  # p pieces of n_layer + 2 layers
    rng = np.random.default_rng(seed)
    x, y = rng.integers(0, 16, (2 * m, 4)), rng.integers(0, 16, (2 * m, 4))
    loss, want = serial_step(cfg, x, y)
    results = run(_dual_rank, ranks=p, m=m, x=x, y=y, cfg=cfg)
    for s, (stats, (copy0, _)) in enumerate(results):
        mirror = results[p - 1 - s][1][1]
        assert copy0.keys() == mirror.keys()
        for name, g in copy0.items():
            assert np.array_equal(g, mirror[name]), (s, name)
            np.testing.assert_allclose(g, want[name], rtol=0, atol=1e-12, err_msg=name)
        assert (stats.loss is not None) == (s in (0, p - 1))
        if stats.loss is not None:
            assert stats.loss == pytest.approx(loss, abs=1e-12)
    assert {n for _, (c0, _) in results for n in c0} == set(want)
