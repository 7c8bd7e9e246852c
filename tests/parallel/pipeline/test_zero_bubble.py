"""ZB-H1: valid, deadlock-free, a third of 1F1B's bubble; on threads equal to 1F1B and the serial model."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minidist.comm import run
from minidist.nn import GPTConfig
from minidist.parallel.pipeline.dualpipe import dualpipe_v
from minidist.parallel.pipeline.placement import looped
from minidist.parallel.pipeline.schedule import BackwardInput, BackwardWeight, ScheduleError, one_f_one_b
from minidist.parallel.pipeline.simulate import DeadlockError, ascii_timeline, simulate
from minidist.parallel.pipeline.zb_v import zb_v
from minidist.parallel.pipeline.zero_bubble import (
    as_schedule,
    greedy_order,
    unit_makespan,
    zb_h1,
    zb_h2,
    zb_h2_bubble_formula,
)
from minidist.parallel.three_d import gather_full_state, max_state_diff, train_3d, train_serial
from tests.parallel.pipeline.conftest import pipeline_step, serial_step

ROOT = Path(__file__).resolve().parents[3]

CFG = GPTConfig(vocab_size=16, block_size=4, n_layer=3, n_head=2, d_model=8, dtype="float64")


@pytest.mark.parametrize("p", range(2, 9))
def test_deadlock_free_for_p_2_to_8(p):
    """Both with rendezvous sends (the strict model) and with background sends (the runtime's)."""
    for m in range(p, 2 * p + 3):
        for buffered in (False, True):
            r = simulate(zb_h1(p, m), 1.0, 2.0, buffered_sends=buffered)
            assert r.makespan > 0


@pytest.mark.parametrize("p", range(2, 9))
def test_unit_makespan_is_the_simulated_step(p):
    """`zb_h1` keeps the shortest of its candidate orders by `unit_makespan` (each op as early as its
    input allows, F = B = W = 1): that is exactly what the simulator gives the same orders, ZB-H1's
    and ZB-H2's (one of each candidate "W first at the cap" on the last k stages)."""
    place = looped(p)
    unit = dict(fwd_time=1, bwd_time=2, input_time=1, weight_time=1)
    for m in (p, 2 * p, 2 * p + 3):
        orders = [greedy_order(place, m, lambda s, c: p - s, held=p, w_first_at_cap=range(p - k, p))
                  for k in range(p)]
        if m >= 2 * p - 1:
            orders.append(greedy_order(place, m, lambda s, c: 2 * (p - s) - 1, held=2 * p - 1))
        for order in orders:
            assert unit_makespan(order, place) == simulate(as_schedule(order, place), **unit).makespan


def test_fewer_microbatches_than_the_minimum_is_refused():
    with pytest.raises(ScheduleError, match="zb_h1 needs num_microbatches >= 4 for num_stages=4, got 3"):
        zb_h1(4, 3)
    with pytest.raises(ScheduleError, match="num_stages must be an int >= 1"):
        zb_h1(0, 3)


@pytest.mark.parametrize("p", range(2, 9))
def test_bubble_against_formula(p):
    """F = B = W = 1. 1F1B (its backward B + W = 2): every stage busy 3m of (m + p - 1)·3, bubble
    (p-1)/(m+p-1). ZB-H1: only the B chain waits, makespan 3m + p - 1 ideally, bubble (p-1)/(3m+p-1);
    the memory bound (at most p microbatches from F to W) may add up to 4 steps."""
    for m in (p, 2 * p, 16):
        ob = simulate(one_f_one_b(p, m), fwd_time=1, bwd_time=2)
        zb = simulate(zb_h1(p, m), fwd_time=1, bwd_time=2, input_time=1, weight_time=1, buffered_sends=True)
        assert ob.bubble == pytest.approx((p - 1) / (m + p - 1))
        ideal = 3 * m + p - 1
        assert ideal <= zb.makespan <= ideal + 4
        assert zb.bubble == pytest.approx(1 - 3 * m / zb.makespan)
        assert zb.bubble < ob.bubble
        if m >= 2 * p:
            assert zb.bubble <= 0.7 * ob.bubble
        if m == 16 and p <= 4:
            assert zb.bubble <= (p - 1 + 4) / (3 * m + p - 1 + 4)


def test_memory_bound_and_timeline_letters():
    """No stage holds more than p microbatches between F and W (1F1B's stage 0 peak); W is drawn 'W'."""
    for p in range(2, 9):
        for m in (p, 2 * p):
            for ops in zb_h1(p, m):
                held = peak = 0
                for i in ops:
                    held += type(i).__name__ == "Forward"
                    held -= isinstance(i, BackwardWeight)
                    peak = max(peak, held)
                assert peak <= p
    art = ascii_timeline(simulate(zb_h1(2, 2), 1, 2, input_time=1, weight_time=1), width=28)
    assert "W" in art and "B" in art and "F" in art


# -- ZB-H2 -------------------------------------------------------------------------------------------

def _held_to_w(ops) -> int:
    """Most microbatches between their Forward and their BackwardWeight at once (what W keeps alive)."""
    held = peak = 0
    for i in ops:
        held += type(i).__name__ == "Forward"
        held -= isinstance(i, BackwardWeight)
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("p", range(2, 9))
def test_zb_h2_deadlock_free_and_at_the_rectangle_bound(p):
    """F = B = W = 1: the last stage starts at p-1 and then has 3m of work, so no order beats a
    makespan of 3m + p - 1 (bubble (p-1)/(3m+p-1)); ZB-H2's extra warm-up reaches it exactly. Peak:
    2p - 1 microbatches from F to W on stage 0 (1F1B's: p), 2(p-s) - 1 from F to B on stage s."""
    for m in range(2 * p - 1, 2 * p + 3):
        r = simulate(zb_h2(p, m), 1, 2, input_time=1, weight_time=1, buffered_sends=True)
        assert r.makespan == 3 * m + p - 1
        assert r.bubble == pytest.approx((p - 1) / (3 * m + p - 1))
        assert r.bubble == pytest.approx(zb_h2_bubble_formula(p, m))
        sched = zb_h2(p, m)
        assert _held_to_w(sched[0]) == 2 * p - 1
        assert max(_held_to_w(ops) for ops in sched) == 2 * p - 1
        assert r.peak_activations == [2 * (p - s) - 1 for s in range(p)]
        assert simulate(sched, 1, 2, input_time=1, weight_time=1).makespan > 0  # rendezvous sends too


def test_zb_h2_beats_zb_h1_at_twice_the_memory():
    for p, m in ((4, 8), (8, 16)):
        h1 = simulate(zb_h1(p, m), 1, 2, input_time=1, weight_time=1, buffered_sends=True)
        h2 = simulate(zb_h2(p, m), 1, 2, input_time=1, weight_time=1, buffered_sends=True)
        assert h2.bubble < h1.bubble
        assert max(map(_held_to_w, zb_h2(p, m))) == 2 * p - 1 > max(map(_held_to_w, zb_h1(p, m))) == p


def test_zb_h2_needs_2p_minus_1_microbatches():
    with pytest.raises(ScheduleError, match="zb_h2 needs num_microbatches >= 7 for num_stages=4, got 6"):
        zb_h2(4, 6)


@pytest.mark.parametrize("p,extra,layers", [(2, 0, 2), (3, 1, 3), (4, 0, 2)])
def test_zb_h2_on_threads_equals_the_serial_model(step_vs_serial, p, extra, layers):
    _, diff, dloss = step_vs_serial("zb-h2", p, 2 * p - 1 + extra, layers, seed=p + extra)
    assert diff <= 1e-12 and dloss <= 1e-12


# -- the runtime on threads ---------------------------------------------------------------------------

@given(p=st.integers(2, 4), extra=st.integers(0, 3), layers=st.integers(2, 4), seed=st.integers(0, 99))
@settings(max_examples=8, deadline=None)
def test_zb_h1_equals_1f1b_bit_for_bit_and_the_serial_model(p, extra, layers, seed):
    """Same microbatches, W's in microbatch order as 1F1B's backwards: the gradients are 1F1B's exactly
    and the serial model's to rounding."""
    m = p + extra
    cfg = CFG.replace(n_layer=layers)
    rng = np.random.default_rng(seed)
    x, y = rng.integers(0, 16, (2 * m, 4)), rng.integers(0, 16, (2 * m, 4))
    loss, want = serial_step(cfg, x, y)
    zb_stats, got = pipeline_step("zb-h1", p, m, cfg, x, y)
    _, ref = pipeline_step("1f1b", p, m, cfg, x, y)
    assert got.keys() == want.keys()
    for name in want:
        assert np.array_equal(got[name], ref[name]), name
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-12, err_msg=name)
    assert zb_stats[-1].loss == pytest.approx(loss, abs=1e-12)
    sched = zb_h1(p, m)
    for s, stats in enumerate(zb_stats):
        assert stats.peak_weight_queue_bytes > 0  # B kept (X, G) for W, and it was counted
        assert sum(isinstance(i, BackwardInput) for i in sched[s]) == m


# -- composed with DDP (and TP) on a mesh; under mpirun ---------------------------------------------

def _train_rank(comm, batches, **kw):
    result = train_3d(comm, CFG.replace(n_layer=2), batches, lr=0.1, optimizer="adamw", **kw)
    return gather_full_state(comm, result), result.losses


@pytest.mark.parametrize("dp,pp,tp,m", [(2, 2, 1, 2), (2, 2, 2, 3), (1, 4, 1, 4)])
def test_zb_h1_composes_with_ddp_and_tp(dp, pp, tp, m):
    """DDP syncs on each chunk's last W (its gradients are complete only then): the trained
    parameters equal the serial model's over two AdamW steps."""
    rng = np.random.default_rng(dp + pp + tp + m)
    batches = [(rng.integers(0, 16, (dp * m * 2, 4)), rng.integers(0, 16, (dp * m * 2, 4))) for _ in range(2)]
    want, want_losses = train_serial(CFG.replace(n_layer=2), batches, lr=0.1, optimizer="adamw")
    results = run(_train_rank, ranks=dp * pp * tp, batches=batches, dp=dp, pp=pp, tp=tp, microbatches=m,
                  schedule="zb-h1")
    state, losses = results[0]
    assert max_state_diff(state, want) <= 1e-9
    np.testing.assert_allclose(losses, want_losses, rtol=0, atol=1e-9)


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun (pip install mpich)")
@pytest.mark.timeout(60)
def test_lesson_zb_h1_under_mpirun_passes_its_check():
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("MINIDIST_TRANSPORT", None)
    cmd = ["mpirun", "-n", "4", sys.executable, "-m", "minidist.lessons.pipeline", "--steps", "3",
           "--dp", "1", "--schedule", "zb-h1", "--width", "64", "--seq", "32"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=50, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert re.search(r"serial twin .* PASS", res.stdout), res.stdout
    assert "(p-1)/(3m+p-1) = 3/27" in res.stdout and "ZB-H1 bytes" in res.stdout


def test_zb_h1_gap_is_the_memory_cap():
    """p = 4, m = 8: within 1F1B's cap (p held from F to W) the plain greedy takes 29 steps; one more
    held and it reaches the floor 3m + p - 1 = 27; zb_h1 (W first at the cap on some last stages)
    takes 28 within the cap."""
    unit = dict(fwd_time=1, bwd_time=2, input_time=1, weight_time=1)
    capped = as_schedule(greedy_order(looped(4), 8, lambda s, c: 4 - s, held=4), looped(4))
    roomier = as_schedule(greedy_order(looped(4), 8, lambda s, c: 4 - s, held=5), looped(4))
    assert simulate(capped, **unit).makespan == 29
    assert simulate(roomier, **unit).makespan == 27
    assert simulate(zb_h1(4, 8), **unit).makespan == 28


@pytest.mark.parametrize("p", range(2, 9))
def test_zb_h1_is_at_most_one_step_above_the_floor_within_the_cap(p):
    unit = dict(fwd_time=1, bwd_time=2, input_time=1, weight_time=1)
    for m in list(range(p, 2 * p + 3)) + [16]:
        sched = zb_h1(p, m)
        assert 3 * m + p - 1 <= simulate(sched, **unit).makespan <= 3 * m + p
        assert max(map(_held_to_w, sched)) <= p


def test_simulator_times_a_schedule_with_the_sends_it_declares():
    """Zero-bubble schedules declare background sends (the runtime's): the default simulation uses them;
    under strict rendezvous ZB-H2 waits (51 steps, not 27) and the V schedules cross and deadlock."""
    unit = dict(fwd_time=1, bwd_time=2, input_time=1, weight_time=1)
    assert zb_h2(4, 8).buffered_sends and not one_f_one_b(4, 8).buffered_sends
    assert simulate(zb_h2(4, 8), **unit).makespan == 27
    assert simulate(zb_h2(4, 8), buffered_sends=False, **unit).makespan == 51
    for sched in (zb_v(4, 8), dualpipe_v(4, 8)):
        simulate(sched)
        with pytest.raises(DeadlockError, match="stage 0 blocked at"):
            simulate(sched, buffered_sends=False)
