"""The graders' shared comparison (``minidist.grading.assert_close``): exact by default, a stated
tolerance otherwise, NaN equal to NaN, and a failure that names where, how many and the first ones."""

import numpy as np
import pytest

from minidist.grading import assert_close


def test_exact_by_default_one_ulp_fails():
    x = np.array([1.0, 2.0, 3.0])
    assert_close(x, x.copy(), "rank 0")
    with pytest.raises(AssertionError, match=r"rank 0: 1 of 3 elements differ \(exact; shape \(3,\)"):
        assert_close(np.nextafter(x, 4.0) * [0, 1, 0] + x * [1, 0, 1], x, "rank 0")


def test_atol_alone_allows_exactly_its_margin():
    """atol=1e-6 with rtol=0: 1e-6 apart passes, 2e-6 apart fails (an atol-only comparison must not
    turn exact, nor take a relative margin)."""
    want = np.array([1000.0, 0.0])
    assert_close(want + [1e-6, -1e-6], want, "w", atol=1e-6)
    with pytest.raises(AssertionError, match=r"2 of 2 elements differ \(rtol=0, atol=1e-06"):
        assert_close(want + [2e-6, -2e-6], want, "w", atol=1e-6)


def test_rtol_scales_with_the_expected_value():
    want = np.array([1e6, 1.0])
    assert_close(want * (1 + 0.5e-9), want, "w", rtol=1e-9)
    with pytest.raises(AssertionError, match=r"1 of 2 elements differ"):
        assert_close(want + [0.0, 1e-6], want, "w", rtol=1e-9)


def test_nan_equals_nan_but_not_a_number():
    assert_close([np.nan, 1.0], [np.nan, 1.0], "w")
    with pytest.raises(AssertionError, match=r"\[0\] expected nan, got 1"):
        assert_close([1.0, 1.0], [np.nan, 1.0], "w")


def test_a_failure_shows_the_first_elements_and_the_largest_error():
    want = np.zeros((2, 3))
    got = want.copy()
    got[0, 1], got[1, 2] = 0.5, -2.0
    with pytest.raises(AssertionError) as e:
        assert_close(got, want, "rank 1 of 2, n=6")
    msg = str(e.value)
    assert msg.startswith("rank 1 of 2, n=6: 2 of 6 elements differ")
    assert "[0, 1] expected 0, got 0.5; [1, 2] expected 0, got -2" in msg and "max abs error 2" in msg


def test_a_wrong_shape_or_none_is_named():
    with pytest.raises(AssertionError, match=r"w: returned None, expected an array of shape \(2,\)"):
        assert_close(None, np.zeros(2), "w")
    with pytest.raises(AssertionError, match=r"w: shape \(3,\) \(float64\), expected \(2,\)"):
        assert_close(np.zeros(3), np.zeros(2), "w")
