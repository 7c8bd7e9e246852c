"""FP8 scaling's helpers on their own (minidist/parallel/memory/fp8_scaling.py and the recipe's
refusals), against values worked out by hand: the power-of-two scale rule at its boundaries (an amax
exactly ``max · 2^k``, one ulp past it, margins, zero and non-finite amaxes), delayed scaling's amax
window (the max over the last ``length`` steps, the oldest dropped), per-tile scales with ragged
edges, and which tile each operand of a block-scaled GEMM gets."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist.parallel.memory.fp8 import Fp8Quantizer, Fp8Recipe
from minidist.parallel.memory.fp8_formats import E4M3, E5M2
from minidist.parallel.memory.fp8_scaling import (
    AmaxHistory,
    amax_of,
    block_quantize,
    block_scales,
    expand_scales,
    pow2_scale,
    quantize_scaled,
)

# (amax, format, margin, the smallest power of two s with amax / s <= max, times 2^margin), by hand
SCALES = [
    (448.0, E4M3, 0, 1.0),                 # amax exactly max: s = 1, not 2
    (np.nextafter(448.0, 1e9), E4M3, 0, 2.0),  # one ulp past max: the next power
    (224.0, E4M3, 0, 0.5),                 # max / 2 exactly: 224 / 0.5 = 448 fits
    (224.5, E4M3, 0, 1.0),
    (896.0, E4M3, 0, 2.0),                 # max · 2 exactly
    (448.0 * 2.0 ** -20, E4M3, 0, 2.0 ** -20),
    (512.0, E4M3, 0, 2.0),                 # a power of two that is not max · 2^k: 512 / 1 > 448
    (256.0, E4M3, 0, 1.0),                 # 256 / 0.5 = 512 > 448
    (1.0, E4M3, 0, 2.0 ** -8),             # 1 / 2^-8 = 256 <= 448 < 512
    (57344.0, E5M2, 0, 1.0),               # e5m2's max exactly
    (57345.0, E5M2, 0, 2.0),
    (1.0, E5M2, 0, 2.0 ** -15),            # 2^15 = 32768 <= 57344 < 65536
    (448.0, E4M3, 2, 4.0),                 # margin: two binades of headroom
    (448.0, E4M3, -1, 0.5),
    (0.0, E4M3, 0, 1.0),                   # nothing to cover
    (0.0, E4M3, 3, 8.0),                   # ... still times 2^margin
    (math.inf, E4M3, 1, 2.0),              # not finite: the loss scaler's business
    (math.nan, E5M2, 0, 1.0),
    (-5.0, E4M3, 0, 1.0),                  # an amax is never negative: treated as nothing to cover
]


@pytest.mark.parametrize("amax, fmt, margin, want", SCALES)
def test_pow2_scale_table(amax, fmt, margin, want):
    assert pow2_scale(amax, fmt, margin) == want
    assert pow2_scale(amax, fmt.name, margin) == want  # the name as well as the Format


@given(st.integers(-40, 40), st.sampled_from([E4M3, E5M2]), st.integers(-3, 3))
def test_an_amax_exactly_on_max_times_a_power_of_two_takes_that_power(k, fmt, margin):
    """amax = max · 2^k fits under s = 2^k exactly (amax / s = max); one ulp more needs 2^(k+1)."""
    amax = fmt.max * 2.0 ** k
    assert pow2_scale(amax, fmt, margin) == 2.0 ** (k + margin)
    assert pow2_scale(np.nextafter(amax, np.inf), fmt, margin) == 2.0 ** (k + 1 + margin)
    assert pow2_scale(np.nextafter(amax, 0.0), fmt, margin) == 2.0 ** (k + margin)


def test_amax_of_is_the_largest_magnitude_and_zero_for_nothing():
    assert amax_of(np.array([-3.0, 2.0, 0.5])) == 3.0
    assert amax_of(np.zeros((0, 4), np.float32)) == 0.0
    assert amax_of(np.array([[1.0, -448.0]], np.float32)) == 448.0


def test_quantize_scaled_divides_rounds_and_multiplies_back():
    # 3.3 / 0.5 = 6.6: e4m3 has spacing 0.5 in [4, 8), so 6.5, times 0.5 = 3.25; 1000 / 1 saturates to 448
    got = quantize_scaled(np.array([3.3, -3.3, 1000.0], np.float32), E4M3, 0.5)
    np.testing.assert_array_equal(got, [3.25, -3.25, 224.0])
    assert quantize_scaled(np.array([3.3]), E4M3, 0.5).dtype == np.float64  # fp64 stays fp64


def test_the_amax_window_is_the_max_of_the_last_length_steps():
    h = AmaxHistory(3)
    assert h.amax(5.0) == 5.0  # empty window: the amax it is given (the first step)
    for a in (1.0, 8.0, 2.0):
        h.record(a)
    assert h.values == [1.0, 8.0, 2.0] and h.amax(0.0) == 8.0  # the max, not the newest
    h.record(3.0)
    assert h.values == [8.0, 2.0, 3.0] and h.amax(100.0) == 8.0  # the oldest dropped; `first` unused
    h.record(4.0)
    assert h.values == [2.0, 3.0, 4.0] and h.amax(0.0) == 4.0  # 8 left the window after 3 more steps
    assert h.scale(E4M3, 0.0) == 2.0 ** -6   # 4 / 2^-6 = 256 <= 448
    assert h.scale(E4M3, 0.0, margin=1) == 2.0 ** -5
    assert h.state_dict() == {"length": 3, "values": [2.0, 3.0, 4.0]}


def test_a_window_of_one_is_the_last_step_and_inf_nan_are_not_recorded():
    h = AmaxHistory(1)
    h.record(900.0)
    assert h.scale(E4M3, 1.0) == 4.0  # 900 / 2 > 448, 900 / 4 = 225
    h.record(1.0)
    assert h.values == [1.0] and h.amax(0.0) == 1.0
    h.record(math.inf)
    h.record(math.nan)
    assert h.values == [1.0]


@pytest.mark.parametrize("length", [0, -1, 1.5, "16", None])
def test_an_amax_window_that_is_not_a_positive_integer_is_refused(length):
    with pytest.raises(ValueError, match=f"AmaxHistory length={length!r} must be an integer >= 1"):
        AmaxHistory(length)


def test_block_scales_one_per_tile_by_hand():
    x = np.array([[448.0, 1.0, 449.0, 0.0],
                  [0.0, 0.0, 224.0, -896.0]], np.float32)
    # tiles 1 x 2: row 0 amaxes 448 (s 1), 449 (s 2); row 1: 0 (s 1: nothing to cover), 896 (s 2)
    np.testing.assert_array_equal(block_scales(x, E4M3, (1, 2)), [[1.0, 2.0], [1.0, 2.0]])
    # one 2 x 4 tile: amax 896; margin 1 doubles it
    np.testing.assert_array_equal(block_scales(x, E4M3, (2, 4), margin=1), [[4.0]])


def test_block_scales_with_ragged_edge_tiles_in_both_directions():
    x = np.array([[1.0, 2.0, 896.5],
                  [3.0, 4.0, 5.0],
                  [0.5, 0.25, 0.0]], np.float32)
    # 2 x 2 tiles: rows {0,1} x cols {0,1}: amax 4 -> 2^-6 (256 <= 448 < 512); rows {0,1} x col 2:
    # 896.5 -> 4 (896.5 / 2 > 448); row 2 x cols {0,1}: 0.5 -> 2^-9 (256); row 2 x col 2: 0 -> 1
    want = [[2.0 ** -6, 4.0], [2.0 ** -9, 1.0]]
    np.testing.assert_array_equal(block_scales(x, E4M3, (2, 2)), want)
    # 1 x 2 tiles (rows and columns blocked differently): row 0 amaxes 2 -> 2^-7 and 896.5 -> 4; row 1:
    # 4 -> 2^-6 and 5 -> 2^-6 (320 <= 448 < 640); row 2: 0.5 -> 2^-9 and 0 -> 1
    np.testing.assert_array_equal(block_scales(x, E4M3, (1, 2)),
                                  [[2.0 ** -7, 4.0], [2.0 ** -6, 2.0 ** -6], [2.0 ** -9, 1.0]])
    np.testing.assert_array_equal(block_scales(x.T, E4M3, (2, 1)),
                                  [[2.0 ** -7, 2.0 ** -6, 2.0 ** -9], [4.0, 2.0 ** -6, 1.0]])
    q, scales = block_quantize(x, E4M3, (2, 2))
    np.testing.assert_array_equal(scales, want)
    assert q.shape == x.shape
    np.testing.assert_array_equal(q[:, :2], x[:, :2])  # small powers of two / halves: exact
    assert q[0, 2] == 896.0  # 896.5 / 4 = 224.125 rounds to 224 (e4m3 spacing 16 in [128, 256))


def test_a_tile_with_inf_or_nan_gets_it_as_its_scale_the_others_theirs():
    x = np.array([[1.0, np.inf, 2.0, 3.0],
                  [np.nan, 0.0, 448.0, 1.0]], np.float32)
    s = block_scales(x, E4M3, (1, 2))
    assert s[0, 0] == np.inf and np.isnan(s[1, 0])
    assert s[0, 1] == 2.0 ** -7 and s[1, 1] == 1.0  # 3 / 2^-7 = 384; 448 / 1


def test_expand_scales_gives_each_element_its_tiles_scale():
    scales = np.array([[1.0, 2.0], [4.0, 8.0]])
    want = [[1, 1, 1, 2, 2],
            [1, 1, 1, 2, 2],
            [4, 4, 4, 8, 8]]
    np.testing.assert_array_equal(expand_scales(scales, (2, 3), (3, 5)), want)
    np.testing.assert_array_equal(expand_scales(np.array([[1.0, 2.0]]), (1, 3), (1, 6)), [[1, 1, 1, 2, 2, 2]])


@pytest.mark.parametrize("role, tiles", [("x", (4, 2)), ("g", (4, 2)), ("w", (2, 2)), ("xt", (2, 4)),
                                         ("gt", (2, 4))])
def test_block_scaling_tiles_each_role_along_what_its_gemm_sums(role, tiles):
    """block = 2 on a 4 x 4 operand: activations and gradients 1 x 2 (per row), weights 2 x 2, and dW's
    operands x^T, dy 2 x 1 (per column, along the tokens the weight gradient sums over)."""
    q = Fp8Quantizer(Fp8Recipe(block=2))
    a = np.arange(1, 17, dtype=np.float32).reshape(4, 4)
    q.quantize(role, a, E4M3, None)
    assert q.last[role].shape == tiles
    if role in ("xt", "gt"):  # column 0, rows 0-1 holds 1 and 5: amax 5 -> 2^-6 (320 <= 448)
        assert q.last[role][0, 0] == 2.0 ** -6


@pytest.mark.parametrize("kw, says", [
    (dict(block=0), "block=0 must be a positive integer"),
    (dict(block=-2), "block=-2 must be a positive integer"),
    (dict(block=2.0), "block=2.0 must be a positive integer"),
    (dict(history=0), "history=0 must be a positive integer"),
    (dict(history=None), "history=None must be a positive integer"),
    (dict(accumulate=(128, 0)), r"accumulate=\(128, 0\) must be None or \(N, mantissa bits\)"),
    (dict(accumulate=(0, 13)), r"accumulate=\(0, 13\)"),
    (dict(accumulate=(128,)), r"accumulate=\(128,\)"),
    (dict(accumulate=(128, 13, 1)), r"accumulate=\(128, 13, 1\)"),
    (dict(accumulate=(128, 13.0)), r"accumulate=\(128, 13.0\)"),
    (dict(scaling="tensor"), "scaling='tensor'; use one of current, delayed, block"),
    (dict(on_overflow="ignore"), "on_overflow='ignore'; use 'skip' or 'raise'"),
])
def test_the_recipe_refuses_each_field_at_its_boundary(kw, says):
    with pytest.raises(ValueError, match=says):
        Fp8Recipe(**kw)


def test_the_recipe_accepts_the_smallest_legal_values():
    r = Fp8Recipe(block=1, history=1, accumulate=(1, 1))
    assert (r.block, r.history, r.accumulate) == (1, 1, (1, 1))
