"""ZB-V: two chunks per rank in a V, deadlock-free, at its floor at 1F1B's memory, equal to serial."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist.lessons import pipeline as lesson
from minidist.parallel.pipeline.schedule import (
    COMPUTE,
    BackwardInput,
    BackwardWeight,
    Forward,
    RecvAct,
    RecvGrad,
    ScheduleError,
    SendAct,
    one_f_one_b,
)
from minidist.parallel.pipeline.simulate import ascii_timeline, simulate
from minidist.parallel.pipeline.zb_v import zb_v, zb_v_bubble_formula
from minidist.parallel.pipeline.zero_bubble import zb_h1
from tests.conftest import budget

ROOT = Path(__file__).resolve().parents[3]
HALF = dict(fwd_time=0.5, bwd_time=1.0, input_time=0.5, weight_time=0.5)  # per piece; a stage forward is 1
NAMES = ("Forward", "BackwardInput", "BackwardWeight")


def _held_to_w(ops) -> int:
    held = peak = 0
    for i in ops:
        held += isinstance(i, Forward)
        held -= isinstance(i, BackwardWeight)
        peak = max(peak, held)
    return peak


F, Bi, W = Forward, BackwardInput, BackwardWeight
# p = 2, m = 4, worked by hand through the phases of torch's ScheduleZBVZeroBubble (and the paper's
# ZB-V): rank r fills the way down (2(p-r) - 1 F0), r pairs F1 F0, p - r triples F1 B1 W1, then
# F0 B0 W0 F1 B1 W1 while forwards last, then r pairs B0 B1, p - r pairs B0 W0, the W's left.
ZBV_RANK0 = [F(0, 0), F(1, 0), F(2, 0), F(0, 1), Bi(0, 1), W(0, 1), F(1, 1), Bi(1, 1), W(1, 1),
             F(3, 0), Bi(0, 0), W(0, 0), F(2, 1), Bi(2, 1), W(2, 1),
             Bi(1, 0), W(1, 0), F(3, 1), Bi(3, 1), W(3, 1), Bi(2, 0), W(2, 0), Bi(3, 0), W(3, 0)]
ZBV_RANK1 = [F(0, 0), F(0, 1), F(1, 0), F(1, 1), Bi(0, 1), W(0, 1),
             F(2, 0), Bi(0, 0), W(0, 0), F(2, 1), Bi(1, 1), W(1, 1),
             F(3, 0), Bi(1, 0), W(1, 0), F(3, 1), Bi(2, 1), W(2, 1),
             Bi(2, 0), Bi(3, 1), Bi(3, 0), W(2, 0), W(3, 1), W(3, 0)]


def test_order_by_hand():
    sched = zb_v(2, 4)
    assert [[i for i in ops if isinstance(i, COMPUTE)] for ops in sched] == [ZBV_RANK0, ZBV_RANK1]


@pytest.mark.parametrize("p", range(2, 9))
def test_at_the_floor_for_m_from_2p_minus_1_no_rank_waiting(p):
    """The floor with F = B = W per stage (a piece: half of each): the last rank's first piece starts
    after p-1 half-stage forwards, then it has 3m of work: 3m + (p-1)/2, bubble (p-1)/(6m+p-1).
    The proof sketch: in steps of one piece, rank r's k-th op starts at r + k -- no rank ever waits
    once it has started -- so rank p-1 ends at (p-1) + 6m."""
    for m in [*range(2 * p - 1, 2 * p + 4), 3 * p + 1, 16]:
        sched = zb_v(p, m)
        r = simulate(sched, **HALF)
        assert r.makespan == 3 * m + (p - 1) / 2
        assert r.bubble == pytest.approx(zb_v_bubble_formula(p, m))
        per_piece = simulate(sched, fwd_time=1, bwd_time=2, input_time=1, weight_time=1)
        for rank in range(p):
            starts = [e["t0"] for e in per_piece.events if e["rank"] == rank and e["name"] in NAMES]
            assert starts == [rank + k for k in range(6 * m)], rank
        assert max(_held_to_w(ops) for ops in sched) <= 2 * p  # 1F1B's p stages, in half-stage pieces


@pytest.mark.parametrize("p", range(2, 9))
def test_below_2p_minus_1_the_greedy_order_at_m_equals_p_is_at_the_floor(p):
    """m = p (too few for the handcrafted phases): the greedy list order under the same memory cap,
    at the floor too; for p < m < 2p - 1 within max(1, p-3) half-stage steps of it."""
    for m in range(p, 2 * p - 1):
        sched = zb_v(p, m)
        r = simulate(sched, **HALF)
        bound = 3 * m + (p - 1) / 2
        assert bound <= r.makespan <= bound + (0 if m == p else max(0.5, (p - 3) / 2))
        assert max(_held_to_w(ops) for ops in sched) <= 2 * p
    assert 2 * p == 2 * max(simulate(one_f_one_b(p, 2 * p)).peak_activations)


@pytest.mark.parametrize("p,m", [(4, 8), (8, 16)])
def test_zb_v_beats_zb_h1_and_1f1b(p, m):
    v = simulate(zb_v(p, m), buffered_sends=True, **HALF).bubble
    h1 = simulate(zb_h1(p, m), 1, 2, input_time=1, weight_time=1, buffered_sends=True).bubble
    assert v < h1 < simulate(one_f_one_b(p, m), 1, 2).bubble


def test_the_loss_is_on_rank_0_and_the_turn_is_local():
    """Rank 0 runs piece 0 (chunk 0) and the last piece (chunk 1); rank p-1 hands piece p-1's output to
    piece p in its own instruction list."""
    sched = zb_v(3, 3)
    art = ascii_timeline(simulate(sched, buffered_sends=True, **HALF), width=40)
    assert art.count("\n") == 2 and "W" in art
    def parts(ops):
        return [x for i in ops for x in getattr(i, "ops", (i,))]
    assert SendAct(0, 0) in parts(sched[2]) and RecvAct(0, 1) in parts(sched[2])
    assert not any(isinstance(x, RecvGrad) and x.chunk == 1 for x in parts(sched[0]))  # it computes the loss
    assert any(isinstance(x, RecvAct) and x.chunk == 1 for x in parts(sched[0]))


def test_fewer_microbatches_than_the_minimum_is_refused():
    with pytest.raises(ScheduleError, match="zb_v needs num_microbatches >= 4 for num_stages=4, got 3"):
        zb_v(4, 3)


@given(p=st.integers(2, 3), extra=st.integers(0, 3), more=st.integers(0, 2), seed=st.integers(0, 99))
@budget(6, deadline=None)
def test_on_threads_equals_the_serial_model(step_vs_serial, p, extra, more, seed):
    """2p pieces of a GPT with n_layer + 2 layers: n_layer >= 2p - 2."""
    stats, diff, dloss = step_vs_serial("zb-v", p, p + extra, 2 * p - 2 + more, seed)
    assert diff <= 1e-12 and dloss <= 1e-12
    assert stats[0].loss is not None and all(s.peak_weight_queue_bytes > 0 for s in stats)


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun (pip install mpich)")
@pytest.mark.timeout(90)
@pytest.mark.parametrize("schedule", ["zb-v", "dualpipe-v", "dualpipe"])
def test_lesson_v_schedules_under_mpirun_pass_their_check(schedule):
    """4 MPI processes, 2 pieces each: in a V (the turn on rank 3 is local, the loss on rank 0), or
    one of each of DualPipe's two model copies (the losses on ranks 0 and 3, the copies' gradients
    summed between ranks s and 3 - s)."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("MINIDIST_TRANSPORT", None)
    cmd = ["mpirun", "-n", "4", sys.executable, "-m", "minidist.lessons.pipeline", "--steps", "2",
           "--dp", "1", "--schedule", schedule, "--width", "32", "--seq", "16", "--dtype", "float64"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=80, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert re.search(r"serial twin .* \(tolerance 1.0e-09\)  PASS", res.stdout), res.stdout  # float64
    assert "microbatch-chunks held" in res.stdout


@pytest.mark.parametrize("flags,says", [
    (["--schedule", "zb-v", "--microbatches", "2"], "zb_v needs num_microbatches >= 4 for num_stages=4"),
    (["--schedule", "dualpipe-v", "--microbatches", "4"], "dualpipe_v needs num_microbatches >= 8"),
    (["--schedule", "zb-v", "--layers", "4"], r"8 pipeline stages \(pp=4 x chunks=2\)"),
    (["--schedule", "zb-v", "--chunks", "2"], "--chunks 2 needs --schedule interleaved"),
    (["--schedule", "dualpipe", "--microbatches", "4"], "dualpipe needs num_microbatches >= 8"),
    (["--schedule", "dualpipe", "--pp", "3", "--ranks", "3"], "dualpipe needs an even num_stages"),
])
def test_lesson_refuses_v_flag_combos_before_ranks_start(capsys, flags, says):
    with pytest.raises(SystemExit) as e:
        lesson.main(["--ranks", "4", "--dp", "1", *flags])  # a later --ranks wins
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(says, err), err
