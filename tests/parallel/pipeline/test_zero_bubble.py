"""ZB-H1 at the floor 3m + p - 1 (a hand-worked order and timeline, the paper's (p-1)(F + B - W), its
M_B and M_W), ZB-H2 at its bound; deadlock-free; on threads equal to 1F1B and the serial model."""

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
from minidist.parallel.pipeline.schedule import (
    COMPUTE,
    BackwardInput,
    BackwardWeight,
    Forward,
    ScheduleError,
    one_f_one_b,
)
from minidist.parallel.pipeline.simulate import DeadlockError, ascii_timeline, simulate
from minidist.parallel.pipeline.zb_h2 import zb_h2, zb_h2_bubble_formula
from minidist.parallel.pipeline.zb_v import zb_v
from minidist.parallel.pipeline.zero_bubble import zb_h1, zb_h1_bubble, zb_h1_bubble_formula
from minidist.parallel.three_d import gather_full_state, max_state_diff, train_3d, train_serial
from tests.parallel.pipeline.conftest import pipeline_step, serial_step

ROOT = Path(__file__).resolve().parents[3]
CFG = GPTConfig(vocab_size=16, block_size=4, n_layer=3, n_head=2, d_model=8, dtype="float64")
UNIT = dict(fwd_time=1, bwd_time=2, input_time=1, weight_time=1)  # F = B = W = 1
F, B, W = Forward, BackwardInput, BackwardWeight

# p = 3, m = 4, by hand from the paper's rule: p - s warm-up forwards; per microbatch j: B_j, W_{j-s}
# (put off by s), the next F; then the s W's left.
HAND = [[F(0), F(1), F(2), B(0), W(0), F(3), B(1), W(1), B(2), W(2), B(3), W(3)],
        [F(0), F(1), B(0), F(2), B(1), W(0), F(3), B(2), W(1), B(3), W(2), W(3)],
        [F(0), B(0), F(1), B(1), F(2), B(2), W(0), F(3), B(3), W(1), W(2), W(3)]]
# ... and its timeline in unit steps, by hand: stage s's warm-up ends at p, B_0 comes back at 2p-1-s,
# from then on it never waits; every stage ends at 3m + p - 1 = 14.
HAND_TIMES = [{"F": [0, 1, 2, 7], "B": [5, 8, 10, 12], "W": [6, 9, 11, 13]},
              {"F": [1, 2, 5, 8], "B": [4, 6, 9, 11], "W": [7, 10, 12, 13]},
              {"F": [2, 4, 6, 9], "B": [3, 5, 7, 10], "W": [8, 11, 12, 13]}]


def _compute(ops):
    return [i for i in ops if isinstance(i, COMPUTE)]


def _starts(result, stage, name):
    return [e["t0"] for e in result.events if e["rank"] == stage and e["name"] == name]


def _held_to_w(ops) -> int:
    """Most microbatches between their Forward and their BackwardWeight at once."""
    held = peak = 0
    for i in ops:
        held += isinstance(i, Forward) - isinstance(i, BackwardWeight)
        peak = max(peak, held)
    return peak


def test_order_and_timeline_by_hand():
    sched = zb_h1(3, 4)
    assert [_compute(ops) for ops in sched] == HAND
    r = simulate(sched, **UNIT)
    assert r.makespan == 14 == 3 * 4 + 3 - 1
    for s, want in enumerate(HAND_TIMES):
        for kind, name in (("F", "Forward"), ("B", "BackwardInput"), ("W", "BackwardWeight")):
            assert _starts(r, s, name) == want[kind], (s, kind)


def _proof_times(p, m, s):
    """The proof sketch's start times of stage s's B's: B_0 at 2p-1-s, then each iteration j takes
    1 (its B) + [j >= s] (a W) + [p - s + j < m] (an F) steps without a wait."""
    t, out = 2 * p - 1 - s, []
    for j in range(m):
        out.append(t)
        t += 1 + (j >= s) + (p - s + j < m)
    return out, t + s  # ... and the end: the s W's left after the last iteration


@pytest.mark.parametrize("p", range(2, 9))
def test_floor_memory_and_the_proof_sketch_for_p_2_to_8(p):
    """F = B = W = 1: exactly the floor 3m + p - 1 (bubble (p-1)/(3m+p-1)) for every m >= p; every B
    where the proof sketch puts it; 1F1B's M_B (p - s from F to B on stage s), M_W = s + 1 from B to
    W, p from F to W."""
    for m in [*range(p, 2 * p + 3), 3 * p + 1, 16]:
        sched = zb_h1(p, m)
        r = simulate(sched, **UNIT)
        assert r.makespan == 3 * m + p - 1
        assert r.bubble == pytest.approx((p - 1) / (3 * m + p - 1))
        assert r.bubble == pytest.approx(zb_h1_bubble_formula(p, m))
        for s in range(p):
            b_starts, end = _proof_times(p, m, s)
            assert _starts(r, s, "BackwardInput") == b_starts
            assert end == 3 * m + p - 1
        assert r.peak_activations == [p - s for s in range(p)]
        assert r.peak_pending_weights == [s + 1 for s in range(p)]
        assert [_held_to_w(ops) for ops in sched] == [p] * p


COST = st.sampled_from([0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0])


@given(p=st.integers(2, 8), extra=st.integers(0, 10), f=COST, b=COST, w=COST)
@settings(deadline=None)
def test_bubble_for_unequal_costs_is_the_papers(p, extra, f, b, w):
    """Each stage idles (p-1)(F + B - W) per step where W <= F and W <= B (Qi et al., Table 1); a W
    longer than F or B fills no more than its F or B chain: (p-1)max(F + B - W, F, B) in general."""
    m = p + extra
    r = simulate(zb_h1(p, m), fwd_time=f, bwd_time=b + w, input_time=b, weight_time=w)
    idle = r.makespan - m * (f + b + w)
    if w <= min(f, b):
        assert idle == pytest.approx((p - 1) * (f + b - w), abs=1e-9)
    assert idle == pytest.approx((p - 1) * max(f + b - w, f, b), abs=1e-9)
    assert zb_h1_bubble(p, f, b, w) == pytest.approx(idle, abs=1e-9)


@pytest.mark.parametrize("p", range(2, 9))
def test_deadlock_free_with_rendezvous_and_background_sends(p):
    for m in range(p, 2 * p + 3):
        for buffered in (False, True):
            assert simulate(zb_h1(p, m), **UNIT, buffered_sends=buffered).makespan >= 3 * m + p - 1


def test_fewer_microbatches_than_the_minimum_is_refused():
    with pytest.raises(ScheduleError, match="zb_h1 needs num_microbatches >= 4 for num_stages=4, got 3"):
        zb_h1(4, 3)
    with pytest.raises(ScheduleError, match="num_stages must be an int >= 1"):
        zb_h1(0, 3)


@pytest.mark.parametrize("p", range(2, 9))
def test_a_third_of_1f1bs_bubble(p):
    """1F1B (its backward B + W = 2): each stage idles 3(p-1) steps, (p-1)/(m+p-1); ZB-H1 exactly a
    third of that time, p - 1 steps (the fraction (p-1)/(3m+p-1): a third of 1F1B's when m >> p)."""
    for m in (p, 2 * p, 16):
        ob = simulate(one_f_one_b(p, m), fwd_time=1, bwd_time=2)
        zb = simulate(zb_h1(p, m), **UNIT)
        assert ob.bubble == pytest.approx((p - 1) / (m + p - 1))
        assert ob.makespan - 3 * m == 3 * (p - 1) and zb.makespan - 3 * m == p - 1


def test_timeline_letters():
    art = ascii_timeline(simulate(zb_h1(2, 2), **UNIT), width=28)
    assert "W" in art and "B" in art and "F" in art


# -- ZB-H2 -------------------------------------------------------------------------------------------

def _own_interval_idle(result, p, m, f=1, b=1, w=1):
    """Each stage's idle from its first op to its last (the paper's parallelogram)."""
    out = []
    for s in range(p):
        ev = [e for e in result.events if e["rank"] == s and e["name"] in ("Forward", "BackwardInput",
                                                                            "BackwardWeight")]
        out.append(max(e["t1"] for e in ev) - min(e["t0"] for e in ev) - m * (f + b + w))
    return out


@pytest.mark.parametrize("p", range(2, 9))
def test_zb_h2_deadlock_free_and_at_the_rectangle_bound(p):
    """F = B = W = 1: the last stage starts at p-1 and then has 3m of work, so no order beats a
    makespan of 3m + p - 1; ZB-H2 reaches it. Peak: 2p - 1 microbatches from F to W on stage 0
    (1F1B's: p), 2(p-s) - 1 from F to B on stage s."""
    for m in range(2 * p - 1, 2 * p + 3):
        r = simulate(zb_h2(p, m), **UNIT)
        assert r.makespan == 3 * m + p - 1
        assert r.bubble == pytest.approx(zb_h2_bubble_formula(p, m))
        sched = zb_h2(p, m)
        assert _held_to_w(sched[0]) == 2 * p - 1
        assert max(_held_to_w(ops) for ops in sched) == 2 * p - 1
        assert r.peak_activations == [2 * (p - s) - 1 for s in range(p)]
        assert simulate(sched, buffered_sends=False, **UNIT).makespan > 0  # rendezvous sends too


@pytest.mark.parametrize("p", range(2, 9))
def test_zb_h2_leaves_no_gap_in_any_stages_own_interval(p):
    """The paper's ZB-H2 bubble, (p-1)(F + B - 2W) = 0 over each stage's own interval; ZB-H1 waits
    p - 1 - s there (stage s's warm-up ends at p, its first gradient comes back at 2p - 1 - s)."""
    for m in (2 * p - 1, 2 * p + 2):
        assert _own_interval_idle(simulate(zb_h2(p, m), **UNIT), p, m) == [0] * p
        assert _own_interval_idle(simulate(zb_h1(p, m), **UNIT), p, m) == [p - 1 - s for s in range(p)]


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
    for s, stats in enumerate(zb_stats):  # the runtime's accounting: M_B and M_W apart
        assert stats.peak_microbatches == p - s and stats.peak_pending_weights == s + 1
        one = stats.activation_bytes[(0, 0)]  # equal microbatches save equal bytes
        assert all(b == one for b in stats.activation_bytes.values())
        assert stats.peak_fb_bytes == (p - s) * one
        assert stats.peak_weight_queue_bytes > 0  # B kept (X, G) for W, and it was counted


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
           "--dp", "1", "--schedule", "zb-h1", "--width", "64", "--seq", "32", "--dtype", "float64"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=50, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert re.search(r"serial twin .* \(tolerance 1.0e-09\)  PASS", res.stdout), res.stdout  # float64
    assert "(p-1)/(3m+p-1) = 3/27" in res.stdout and "ZB-H1 bytes" in res.stdout
    assert "M_B mbs" in res.stdout and "M_W mbs" in res.stdout  # the paper's two memories, apart


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
