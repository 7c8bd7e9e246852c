"""Grader for exercises/fp8.py: power-of-two scales, block-wise e4m3 quantization, delayed scales.

Every rule is written out here (``_scale``, ``_tile``): the scale from frexp, each tile quantized by
ml_dtypes' own cast, the delayed window replayed step by step.
"""

import math
import types

import ml_dtypes
import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minidist.grading import assert_close, untouched
from minidist.parallel.memory import fp8_scaling as S

GRADE = settings(max_examples=25, deadline=None, derandomize=True, database=None, report_multiple_bugs=False)
MAX = 448.0


def _scale(amax):
    """2^k for the smallest integer k with amax / 2^k <= 448, by frexp (exact)."""
    if amax <= 0:
        return 1.0
    m, e = math.frexp(amax / MAX)
    return 2.0 ** (e - 1 if m == 0.5 else e)


def _tile(t):
    s = _scale(float(np.abs(t).max()))
    return np.clip(t / s, -MAX, MAX).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.float32(s), s


def check_pow2_scale(impl):
    @GRADE
    @given(amax=st.floats(1e-30, 1e30))
    @example(amax=448.0)  # exactly representable: s = 1
    @example(amax=896.0)  # exactly 2 * 448: s = 2
    @example(amax=449.0)
    @example(amax=1e-3)
    def prop(amax):
        got, want = float(impl.pow2_scale(amax)), _scale(amax)
        assert got == want, (f"pow2_scale({amax!r}) = {got!r}, expected {want!r} (the smallest power of "
                             f"two s with amax / s <= 448)")
    prop()
    got = float(impl.pow2_scale(0.0))
    assert got == 1.0, f"pow2_scale(0.0) = {got!r}, expected 1.0 (nothing to scale)"


def check_block_quantize(impl):
    @GRADE
    @given(rows=st.integers(1, 9), cols=st.integers(1, 9), br=st.integers(1, 4), bc=st.integers(1, 4),
           seed=st.integers(0, 99), spread=st.floats(0, 6))
    @example(rows=4, cols=8, br=1, bc=4, seed=0, spread=6.0)
    @example(rows=5, cols=7, br=2, bc=3, seed=1, spread=3.0)  # ragged on both axes
    def prop(rows, cols, br, bc, seed, spread):
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((rows, cols)) * np.exp(rng.normal(0, spread, (rows, cols)))
        x = x.astype(np.float32)
        q, scales = untouched(impl.block_quantize, ["x", "block_rows", "block_cols"])(x, br, bc)
        q, scales = np.asarray(q), np.asarray(scales)
        shape = (-(-rows // br), -(-cols // bc))
        assert scales.shape == shape, (f"x {x.shape}, tiles {br}x{bc}: scales of shape {scales.shape}, "
                                       f"expected {shape}")
        assert q.shape == x.shape, f"q has shape {q.shape}, expected x's {x.shape}"
        for i in range(shape[0]):
            for j in range(shape[1]):
                want, s = _tile(x[i * br:(i + 1) * br, j * bc:(j + 1) * bc])
                assert float(scales[i, j]) == s, (f"x {x.shape}, tiles {br}x{bc}: tile ({i}, {j}) has scale "
                                                  f"{float(scales[i, j])!r}, expected {s!r} (its own amax)")
                assert_close(q[i * br:(i + 1) * br, j * bc:(j + 1) * bc], want,
                             f"x {x.shape}, tiles {br}x{bc}: tile ({i}, {j}) quantized", rtol=0, atol=0)
    prop()


def _delayed(amaxes, history):
    out = []
    for t, a in enumerate(amaxes):
        window = amaxes[max(0, t - history):t]
        out.append(_scale(max(window) if window else a))
    return out


def check_delayed_scales(impl):
    @GRADE
    @given(amaxes=st.lists(st.floats(1e-3, 1e6), min_size=1, max_size=12), history=st.integers(1, 4))
    @example(amaxes=[1.0, 1.0, 1e4, 1.0, 1.0, 1.0], history=2)  # an outlier sets the scale for 2 steps
    @example(amaxes=[10.0, 1000.0, 5000.0], history=1)  # growing: the window lags one step
    def prop(amaxes, history):
        scales = untouched(impl.delayed_scales, ["amaxes", "history"])(list(amaxes), history)
        got, want = [float(s) for s in scales], _delayed(amaxes, history)
        assert got == want, (f"amaxes {amaxes}, history {history}: scales {got}, expected {want} (step t "
                             f"uses the max of steps t-{history}..t-1; step 0 its own amax)")
    prop()


CHECKS = {"pow2_scale": check_pow2_scale, "block_quantize": check_block_quantize,
          "delayed_scales": check_delayed_scales}
POINTS = {"pow2_scale": 2, "block_quantize": 3, "delayed_scales": 2}


# -- minidist's own implementation (must pass) ---------------------------------------------------

def reference():
    def pow2_scale(amax, fmax=MAX):
        return S.pow2_scale(amax, "e4m3")

    def block_quantize(x, block_rows, block_cols):
        return S.block_quantize(np.asarray(x, np.float32), "e4m3", (block_rows, block_cols))

    def delayed_scales(amaxes, history):
        h, out = S.AmaxHistory(history), []
        for a in amaxes:
            out.append(h.scale("e4m3", a))
            h.record(a)
        return out

    return types.SimpleNamespace(pow2_scale=pow2_scale, block_quantize=block_quantize,
                                 delayed_scales=delayed_scales)


# -- deliberately broken implementations (must fail) ---------------------------------------------

def _floor_scale(amax, fmax=MAX):  # one binade too small: the amax saturates
    return 2.0 ** math.floor(math.log2(amax / fmax)) if amax > 0 else 1.0


def _not_a_power_of_two(amax, fmax=MAX):  # amax / 448: right range, but x / s is rounded
    return amax / fmax if amax > 0 else 1.0


def _one_scale(x, br, bc):  # per-tensor: one amax for every tile
    x = np.asarray(x, np.float32)
    s = _scale(float(np.abs(x).max()))
    q = np.clip(x / s, -MAX, MAX).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.float32(s)
    return q, np.full((-(-x.shape[0] // br), -(-x.shape[1] // bc)), s)


def _tiles_transposed(x, br, bc):  # tiles of bc x br: rows and columns swapped
    return reference().block_quantize(x, bc, br)


def _ragged_edge_dropped(x, br, bc):  # only whole tiles quantized; the edge is left as is
    q, s = reference().block_quantize(x, br, bc)
    r, c = (x.shape[0] // br) * br, (x.shape[1] // bc) * bc
    q = np.array(q)
    q[r:, :], q[:, c:] = np.asarray(x)[r:, :], np.asarray(x)[:, c:]
    return q, s


def _current_amax_included(amaxes, history):  # the window holds this step too: that is current scaling
    return [_scale(max(amaxes[max(0, t - history + 1):t + 1])) for t in range(len(amaxes))]


def _never_recorded(amaxes, history):  # a missed amax update: the first step's amax forever
    return [_scale(amaxes[0]) for _ in amaxes]


def _window_one_too_long(amaxes, history):
    return _delayed(amaxes, history + 1)


def _abs_in_place(x, block_rows, block_cols):  # right tiles, but `np.abs(x, out=x)` for the amax strips
    signs = np.sign(x)                         # the signs off the caller's x
    np.abs(x, out=x)
    return reference().block_quantize(x * signs, block_rows, block_cols)


BROKEN = {"pow2_scale": [_floor_scale, _not_a_power_of_two],
          "block_quantize": [_one_scale, _tiles_transposed, _ragged_edge_dropped, _abs_in_place],
          "delayed_scales": [_current_amax_included, _never_recorded, _window_one_too_long]}
