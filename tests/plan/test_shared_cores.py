"""run_on_cores: a schedule on fewer cores than ranks, checked against what can be written out."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist.parallel.pipeline.simulate import simulate
from minidist.plan.schedules import build
from minidist.plan.shared_cores import run_on_cores

NAMES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-h2", 1), ("zb-v", 2),
         ("dualpipe-v", 2)]


def lists(name, p, m, v):
    try:
        return build(name, p, m, v)
    except Exception:
        return None


@given(st.sampled_from(NAMES), st.integers(2, 5), st.integers(1, 10))
def test_a_core_per_rank_is_the_simulator_with_buffered_sends(named, p, m):
    name, v = named
    sched = lists(name, p, m, v)
    if sched is None:
        return  # too few microbatches for this schedule
    sim = simulate(sched, 1.0 / v, 2.0 / v, buffered_sends=True)
    run = run_on_cores(sched, p, 1.0 / v, 2.0 / v)
    assert run["makespan"] == pytest.approx(sim.makespan) and run["bubble"] == pytest.approx(sim.bubble)


@given(st.sampled_from(NAMES), st.integers(2, 5), st.integers(1, 10), st.integers(1, 3))
def test_one_core_is_always_busy_so_the_makespan_is_all_the_work(named, p, m, replicas):
    """Some rank always has work (the schedule cannot deadlock), so one core never idles: makespan =
    replicas x p stages x m microbatches x (F + B) with F = 1, B = 2 over the v chunks."""
    name, v = named
    sched = lists(name, p, m, v)
    if sched is None:
        return
    run = run_on_cores(sched, 1, 1.0 / v, 2.0 / v, replicas=replicas)
    assert run["makespan"] == pytest.approx(replicas * p * m * 3.0)


def test_gpipe_two_stages_one_microbatch_by_hand():
    """F on stage 0 [0,1], F on stage 1 [1,2], B on 1 [2,4], B on 0 [4,6] -- nothing ever runs
    beside anything, so 1 core or 2 give the same: makespan 6, busy 6 of 2 x 6, bubble 1/2."""
    for cores in (1, 2):
        run = run_on_cores(build("gpipe", 2, 1), cores)
        assert run["makespan"] == pytest.approx(6.0) and run["bubble"] == pytest.approx(0.5)


def test_two_pipelines_on_two_cores_look_like_one_on_one_core():
    """Two identical replicas on 2 cores: each rank's share is what one replica gets on 1 core."""
    for name in ("1f1b", "zb-h1"):
        sched = build(name, 4, 8)
        two, one = run_on_cores(sched, 2, replicas=2), run_on_cores(sched, 1)
        assert two["makespan"] == pytest.approx(one["makespan"])
        assert two["bubble"] == pytest.approx(one["bubble"])


def test_sharing_stretches_a_span_two_ranks_computing_at_once_on_one_core():
    """1F1B, p = 2, m = 2 on 1 core: after stage 0's first F [0,1], stage 0's second F and stage 1's
    first F run together at half speed each, both ending at 3."""
    run = run_on_cores(build("1f1b", 2, 2), 1)
    spans = sorted((t0, t1) for _, name, t0, t1 in run["events"] if name == "Forward")
    assert spans[:3] == [(0.0, 1.0), (1.0, 3.0), (1.0, 3.0)]


def test_no_cores_is_refused():
    with pytest.raises(ValueError, match="cores must be > 0"):
        run_on_cores(build("1f1b", 2, 2), 0)
