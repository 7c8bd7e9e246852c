"""``minidist.resilience.stragglers``: which steps a slowdown covers, how two slowdowns of one rank
combine, and which ranks and layers a spec may name -- boundaries written out by hand."""

import pytest

from minidist.resilience.stragglers import Slow, Slowdown


def test_a_slowdown_starts_at_its_from_step_exactly():
    s = Slowdown([Slow(factor=3.0, rank=1, from_step=4)])
    assert [s.rank_factor(1, t) for t in range(2, 7)] == [1.0, 1.0, 3.0, 3.0, 3.0]
    assert [s.rank_factor(0, t) for t in range(2, 7)] == [1.0] * 5
    layer = Slowdown([Slow(factor=2.0, layer=0, from_step=1)])
    assert [layer.layer_factor(0, t) for t in range(3)] == [1.0, 2.0, 2.0]


def test_two_slowdowns_of_one_rank_multiply():
    s = Slowdown("rank=0,factor=2,from_step=0; rank=0,factor=3,from_step=2; rank=1,factor=5")
    assert [s.rank_factor(0, t) for t in range(4)] == [2.0, 2.0, 6.0, 6.0]
    assert s.rank_factor(1, 0) == 5.0
    both = Slowdown("layer=1,factor=2; layer=1,factor=1.5")
    assert both.layer_factor(1) == 3.0 and both.layer_factor(0) == 1.0


@pytest.mark.parametrize("size,ok", [(2, True), (1, False)])
def test_a_slowdown_of_a_rank_that_does_not_exist_is_refused(size, ok):
    """``rank=1`` names the second rank: fine with 2 ranks, an error (naming the rank) with 1."""
    s = Slowdown("rank=1,factor=2")
    if ok:
        s.check_world(size)
    else:
        with pytest.raises(ValueError, match="slows rank 1, but there are only 1 ranks"):
            s.check_world(size)


@pytest.mark.parametrize("layers,ok", [(3, True), (2, False)])
def test_a_slowdown_of_a_layer_that_does_not_exist_is_refused(layers, ok):
    s = Slowdown("layer=2,factor=2")
    if ok:
        s.check_world(4, num_layers=layers)
    else:
        with pytest.raises(ValueError, match="slows layer 2, but the model has 2 layers"):
            s.check_world(4, num_layers=layers)


def test_a_slowdown_is_charged_to_the_virtual_clock_not_slept():
    """On a rank's virtual clock (a device on which compute is free: only ``advance`` moves it), a
    rank 3x slower with a pace of 10 ms/row over 20 rows lasts 3 x 0.2 s = 0.6 s of virtual time;
    work of 0.5 s (more than the pace) lasts 3 x 0.5 s; and no wall time is spent waiting for it."""
    import time

    from minidist.comm.clock import Device, RankClock
    from minidist.comm.transports.link import Link
    from minidist.trace import clock as trace_clock

    clock = RankClock(Link(0.0, 1e9), Device(1e30, 1e30))
    clock.adopt_thread()
    try:
        s = Slowdown("rank=0,factor=3", pace=0.010)
        wall = time.perf_counter()
        for work, want in [(0.0, 0.6), (0.5, 1.5), (0.1, 0.6)]:
            t0 = trace_clock.now()
            with s.compute(0, 0, rows=20):
                clock.advance(work)  # the block's own work
            assert trace_clock.now() - t0 == pytest.approx(want), (work, want)
        assert time.perf_counter() - wall < 0.5  # 2.7 virtual seconds passed; none were slept
    finally:
        clock.release_thread()
