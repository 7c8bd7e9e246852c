"""ZB-H1's and ZB-H2's numbers and refusals against hand-worked values: the paper's bubble
(p-1)·max(F + B - W, F, B) with each term winning once, the bubble fraction, and the least number of
microbatches each schedule builds with (the boundary built, one fewer refused, naming the minimum)."""

import pytest

from minidist.parallel.pipeline.instructions import ScheduleError
from minidist.parallel.pipeline.zb_h2 import zb_h2, zb_h2_bubble_formula, zb_h2_min_microbatches
from minidist.parallel.pipeline.zero_bubble import (
    zb_h1,
    zb_h1_bubble,
    zb_h1_bubble_formula,
    zb_h1_min_microbatches,
)

# (p, F, B, W, seconds a stage idles), by hand
BUBBLES = [
    (3, 1, 3, 2, 6),      # B wins: 2·max(1+3-2, 1, 3) = 2·3
    (4, 3, 1, 1, 9),      # F (and F + B - W) win: 3·3
    (3, 1, 1, 3, 2),      # W longer than F and B fills nothing more: 2·max(-1, 1, 1)
    (5, 2, 1, 0.5, 10),   # the paper's F + B - W: 4·2.5
    (2, 1, 1, 1, 1),
    (1, 5, 5, 5, 0),      # one stage: no pipeline, no bubble
]


@pytest.mark.parametrize("p, f, b, w, want", BUBBLES)
def test_zb_h1_bubble_seconds_by_hand(p, f, b, w, want):
    assert zb_h1_bubble(p, f, b, w) == pytest.approx(want)


@pytest.mark.parametrize("p, m, want", [(4, 8, 3 / 27), (2, 2, 1 / 7), (1, 4, 0.0), (8, 8, 7 / 31)])
def test_zb_bubble_fractions_by_hand(p, m, want):
    assert zb_h1_bubble_formula(p, m) == pytest.approx(want)
    assert zb_h2_bubble_formula(p, m) == pytest.approx(want)  # the rectangle's bound, the same


@pytest.mark.parametrize("p", [1, 2, 3, 5])
def test_zb_h1_builds_from_p_microbatches_and_refuses_one_fewer(p):
    assert zb_h1_min_microbatches(p) == p
    assert len(zb_h1(p, p)) == p
    if p > 1:
        with pytest.raises(ScheduleError, match=f"zb_h1 needs num_microbatches >= {p} for num_stages={p}, "
                                                f"got {p - 1}"):
            zb_h1(p, p - 1)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_zb_h2_builds_from_2p_minus_1_microbatches_and_refuses_one_fewer(p):
    least = 2 * p - 1
    assert zb_h2_min_microbatches(p) == least
    assert len(zb_h2(p, least)) == p
    if least > 1:
        with pytest.raises(ScheduleError, match=f"zb_h2 needs num_microbatches >= {least} for "
                                                f"num_stages={p}, got {least - 1}"):
            zb_h2(p, least - 1)


@pytest.mark.parametrize("build", [zb_h1, zb_h2])
@pytest.mark.parametrize("p, m, says", [(0, 4, "num_stages must be an int >= 1, got 0"),
                                        (2, 0, "num_microbatches must be an int >= 1, got 0"),
                                        (2.0, 4, "num_stages must be an int >= 1, got 2.0")])
def test_bad_sizes_are_refused_before_the_minimum(build, p, m, says):
    with pytest.raises(ScheduleError, match=says):
        build(p, m)
