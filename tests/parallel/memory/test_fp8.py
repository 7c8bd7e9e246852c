"""FP8: the formats against their definition and ml_dtypes, the scales, the scaled matmul's error bound,
an FP8 layer's gradients against a float64 reference, DDP / TP composition, refusals, the FP8 hook."""

import math
import re

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from minidist.autograd.tensor import Tensor
from minidist.comm import measure, run
from minidist.nn.gpt import GPT, GPTConfig
from minidist.nn.layers import Linear
from minidist.nn.optim import AdamW
from minidist.parallel.data.compress import make_hook, reduce_with_hook
from minidist.parallel.memory import fp8 as fp8mod
from minidist.parallel.memory.fp8 import Fp8Recipe, fp8_linear, fp8_quantizers, remove_fp8
from minidist.parallel.memory.fp8_formats import E4M3, E5M2, from_bits, get_format, round_to_format, to_bits
from minidist.parallel.memory.fp8_scaling import AmaxHistory, block_quantize, pow2_scale
from minidist.parallel.memory.fp8_step import fp8_step

CFG = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, d_model=32)
SPEC = {"e4m3": (4, 3, 7, ml_dtypes.float8_e4m3fn), "e5m2": (5, 2, 15, ml_dtypes.float8_e5m2)}


def definition(name, code):
    """The value of one byte under the format's definition (sign, exponent, mantissa fields)."""
    e_bits, m_bits, bias, _ = SPEC[name]
    s, e, m = code >> 7, (code >> m_bits) & ((1 << e_bits) - 1), code & ((1 << m_bits) - 1)
    sign = -1.0 if s else 1.0
    if name == "e4m3" and e == 15 and m == 7:
        return math.nan  # e4m3fn: only S.1111.111 is NaN, no inf
    if name == "e5m2" and e == 31:
        return math.nan if m else sign * math.inf
    if e == 0:
        return sign * 2.0 ** (1 - bias) * m / 2 ** m_bits
    return sign * 2.0 ** (e - bias) * (1 + m / 2 ** m_bits)


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_every_byte_decodes_to_its_definition_and_rounds_to_itself(name):
    fmt, dtype = get_format(name), SPEC[name][3]
    codes = np.arange(256, dtype=np.uint8)
    ours = np.array([definition(name, int(c)) for c in codes])
    theirs = codes.view(dtype).astype(np.float64)
    np.testing.assert_array_equal(ours, theirs)  # NaN == NaN for assert_array_equal
    assert np.nanmax(ours[np.isfinite(ours)]) == fmt.max
    finite = np.isfinite(ours)
    for saturate in (True, False):
        np.testing.assert_array_equal(round_to_format(ours[finite], fmt, saturate), ours[finite])
    back = to_bits(ours[finite], fmt)
    np.testing.assert_array_equal(from_bits(back, fmt, np.float64), ours[finite])
    nans, infs = (2, 0) if name == "e4m3" else (6, 2)
    assert np.sum(np.isnan(ours)) == nans and np.sum(np.isinf(ours)) == infs


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_midpoints_round_to_even_as_ml_dtypes_casts(name):
    fmt, dtype = get_format(name), SPEC[name][3]
    v = np.unique(np.arange(256, dtype=np.uint8).view(dtype).astype(np.float64))
    v = v[np.isfinite(v)]
    mids = np.concatenate([(v[1:] + v[:-1]) / 2, np.nextafter((v[1:] + v[:-1]) / 2, np.inf)])
    for x in (mids, mids.astype(np.float32)):
        want = x.astype(dtype).astype(x.dtype)
        np.testing.assert_array_equal(round_to_format(x, fmt, saturate=False), want)


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float32, st.integers(1, 200), elements=st.floats(width=32, allow_nan=True,
                                                                       allow_infinity=True)))
def test_unsaturated_rounding_equals_ml_dtypes_on_any_float(x):
    for fmt, dtype in ((E4M3, ml_dtypes.float8_e4m3fn), (E5M2, ml_dtypes.float8_e5m2)):
        with np.errstate(all="ignore"):
            ref = x.astype(dtype).astype(np.float32)
        np.testing.assert_array_equal(round_to_format(x, fmt, saturate=False), ref)


def test_overflow_nan_and_inf_per_format():
    x = np.array([500.0, -1e5, 7e4, np.inf, -np.inf, np.nan, 464.0, 465.0], np.float32)
    e4_plain, e5_plain = round_to_format(x, E4M3, saturate=False), round_to_format(x, E5M2, saturate=False)
    # e4m3fn has no inf: every overflow (and inf) is NaN; 464 is the halfway point to the NaN code: down
    np.testing.assert_array_equal(e4_plain, [np.nan, np.nan, np.nan, np.nan, np.nan, np.nan, 448, np.nan])
    # e5m2 overflows to inf like IEEE; 7e4 > 61440 (halfway from 57344 to 2^16) rounds up, to inf;
    # 464 and 465 lie between 448 and 512 (spacing 64 there): nearer 448
    np.testing.assert_array_equal(e5_plain, [512, -np.inf, np.inf, np.inf, -np.inf, np.nan, 448, 448])
    # training casts saturate finite overflow to ±max; inf and NaN stay (an overflow must show)
    want = [448, -448, 448, np.inf, -np.inf, np.nan, 448, 448]
    np.testing.assert_array_equal(round_to_format(x, E4M3), want)
    want = [512, -57344, 57344, np.inf, -np.inf, np.nan, 448, 448]
    np.testing.assert_array_equal(round_to_format(x, E5M2), want)
    with pytest.raises(ValueError, match="e4m3.*e5m2"):
        get_format("e3m4")


@given(st.floats(1e-30, 1e30), st.sampled_from([E4M3, E5M2]))
def test_pow2_scale_is_the_smallest_power_of_two_that_fits(amax, fmt):
    s = pow2_scale(amax, fmt)
    assert s == 2.0 ** round(math.log2(s))
    assert amax / s <= fmt.max < amax / (s / 2)
    assert pow2_scale(0.0, fmt) == 1.0 and pow2_scale(math.nan, fmt) == 1.0


@given(st.integers(1, 9), st.integers(1, 9), st.sampled_from([(1, 4), (4, 4), (2, 3)]),
       st.integers(0, 2 ** 31))
def test_block_quantize_is_per_tile_quantization(rows, cols, block, seed):
    x = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 10
    q, scales = block_quantize(x, E4M3, block)
    for i in range(0, rows, block[0]):
        for j in range(0, cols, block[1]):
            tile = x[i:i + block[0], j:j + block[1]]
            amax = float(np.abs(tile).max())
            s = 2.0 ** math.ceil(math.log2(amax / 448)) if amax > 0 else 1.0
            assert scales[i // block[0], j // block[1]] == s
            want = (tile / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * s
            np.testing.assert_array_equal(q[i:i + block[0], j:j + block[1]], want)


def test_an_outlier_costs_per_tensor_scaling_the_small_values_and_block_scaling_one_tile():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((8, 256)) * 1e-3).astype(np.float32)
    x[3, 5] = 1e3  # 10^6 times the typical value: the per-tensor scale puts it near 448
    s = pow2_scale(np.abs(x).max(), E4M3)
    per_tensor = round_to_format(x / s, E4M3) * s
    block, _ = block_quantize(x, E4M3, (1, 128))
    small = np.ones_like(x, bool)
    small[3, :128] = False  # the outlier's own 1 x 128 tile
    assert np.mean(per_tensor[small] == 0) > 0.9  # flushed below e4m3's 2^-9 · s
    assert np.all(block[small] != 0)
    assert np.abs(block[small] - x[small]).max() <= np.abs(x[small]).max() / 16  # 3 mantissa bits


# -- the scaled matmul's error bound, written out ------------------------------------------------------------

@pytest.mark.parametrize("recipe", ["current", Fp8Recipe("block", block=4)])
@given(st.integers(1, 6), st.integers(1, 40), st.integers(1, 6), st.integers(0, 2 ** 31))
@settings(max_examples=40, deadline=None)
def test_the_fp8_product_is_within_its_written_out_error_bound(recipe, m, k, n, seed):
    """|Q(x)Q(w) - xw| <= |x| e_w + e_x |w| + e_x e_w + gamma_k |Q(x)||Q(w)|, where e_a per element is
    half a unit in the last place of Q(a): 2^-4 |a| for an e4m3 normal (3 mantissa bits), and at most
    s · 2^-10 (half the smallest subnormal 2^-9, scaled) below the normal range; gamma_k = k u / (1 - k u)
    with u = 2^-24 bounds fp32 accumulation of k exact products."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((m, k)) * np.exp(rng.normal(0, 2, (m, k)))).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    layer = fp8_linear(Linear(k, n, bias=False), recipe)
    layer.weight.data = w
    y = layer(Tensor(x)).data.astype(np.float64)
    q = fp8_quantizers(layer)[""]
    bounds = []
    for a, role in ((x, "x"), (w, "w")):
        s = q.last[role]
        if np.ndim(s):  # per-tile scales, expanded to elements
            tile = (4, 4) if role == "w" else (1, 4)
            s = np.repeat(np.repeat(s, tile[0], 0), tile[1], 1)[:a.shape[0], :a.shape[1]]
        bounds.append(np.maximum(2.0 ** -4 * np.abs(a), s * 2.0 ** -10))
    (ex, ew), u = bounds, 2.0 ** -24
    qx, qw = np.abs(x) + ex, np.abs(w) + ew
    bound = np.abs(x) @ ew + ex @ np.abs(w) + ex @ ew + k * u / (1 - k * u) * (qx @ qw)
    assert np.all(np.abs(y - x.astype(np.float64) @ w) <= bound * (1 + 1e-6))


# -- gradients against a float64 reference of the same quantized computation ---------------------------------

def q64(a, fmt, s):
    """The reference quantizer: float64, ml_dtypes' cast after clipping to ±max (saturation)."""
    f = get_format(fmt)
    return np.clip(a / s, -f.max, f.max).astype(f.dtype).astype(np.float64) * s


def scale64(amax, fmt):
    return 2.0 ** math.ceil(math.log2(amax / get_format(fmt).max)) if amax > 0 else 1.0


def reference_step(x, w, b, g, sx, sw, sg):
    """y, dx, dw, db of y = Q4(x) Q4(w) + b under the given scales, all in float64."""
    qx, qw, qg = q64(x, "e4m3", sx), q64(w, "e4m3", sw), q64(g, "e5m2", sg)
    return qx @ qw + b, qg @ qw.T, qx.T @ qg, g.sum(axis=0)


def grid(rng, shape, top):
    """Integers in [-top, top]: every product and sum below stays exact in fp32, so fp32 accumulation
    must agree with float64 to the last bit."""
    return rng.integers(-top, top + 1, shape).astype(np.float32)


def layer_step(layer, x, g):
    xt = Tensor(x, requires_grad=True)
    y = layer(xt)
    y.backward(g)
    return y.data, xt.grad, layer.weight.grad, layer.bias.grad


def check_delayed_against_reference(history=2, steps=4):
    """Delayed scaling: each step's scale from the max of the previous ``history`` amaxes (the first
    step: its own), the amax recorded after; growing inputs make later steps saturate."""
    rng = np.random.default_rng(1)
    layer = fp8_linear(Linear(24, 8), Fp8Recipe("delayed", history=history))
    w = grid(rng, (24, 8), 200)
    layer.weight.data, layer.bias.data = w, grid(rng, (8,), 5)
    seen = {"x": [], "w": [], "g": []}
    for step in range(steps):
        x, g = grid(rng, (6, 24), 30 * 3 ** step), grid(rng, (6, 8), 9 * 2 ** step)
        layer.weight.grad = layer.bias.grad = None
        got = layer_step(layer, x, g)
        scales = {}
        for role, a, fmt in (("x", x, "e4m3"), ("w", w, "e4m3"), ("g", g, "e5m2")):
            amax = float(np.abs(a).max())
            scales[role] = scale64(max(seen[role][-history:]) if seen[role] else amax, fmt)
            seen[role].append(amax)
        want = reference_step(*(a.astype(np.float64) for a in (x, w, layer.bias.data, g)),
                              scales["x"], scales["w"], scales["g"])
        for a, b, what in zip(got, want, ("y", "dx", "dw", "db")):
            np.testing.assert_array_equal(a, b, err_msg=f"step {step}: {what}")


@pytest.mark.parametrize("scaling", ["current", "block"])
def test_fp8_layer_equals_float64_reference_of_the_same_quantization(scaling):
    rng = np.random.default_rng(0)
    layer = fp8_linear(Linear(24, 8), Fp8Recipe(scaling, block=8))
    x, w, g = grid(rng, (6, 24), 255), grid(rng, (24, 8), 255), grid(rng, (6, 8), 255)
    x[0, :8] *= 1  # tiles with very different amaxes: the per-tile scales matter
    x[1, 8:16] = np.sign(x[1, 8:16])
    layer.weight.data, layer.bias.data = w, grid(rng, (8,), 5)
    got = layer_step(layer, x, g)
    x64, w64, g64, b64 = (a.astype(np.float64) for a in (x, w, g, layer.bias.data))
    if scaling == "current":
        want = reference_step(x64, w64, b64, g64, scale64(np.abs(x).max(), "e4m3"),
                              scale64(np.abs(w).max(), "e4m3"), scale64(np.abs(g).max(), "e5m2"))
    else:
        want = deepseek_block_step(x64, w64, b64, g64, 8)
    assert not np.array_equal(want[0], x64 @ w64 + b64)  # the quantization did round something
    for a, b, what in zip(got, want, ("y", "dx", "dw", "db")):
        np.testing.assert_array_equal(a, b, err_msg=what)


def tiles(a, fmt, bh, bw):
    """a (float64) rounded to ``fmt`` with one power-of-two scale per bh x bw tile, written out."""
    out = np.empty_like(a)
    for i in range(0, a.shape[0], bh):
        for j in range(0, a.shape[1], bw):
            t = a[i:i + bh, j:j + bw]
            out[i:i + bh, j:j + bw] = q64(t, fmt, scale64(np.abs(t).max(), fmt))
    return out


def deepseek_block_operands(x, w, g, n):
    """The FP8 operands of one Linear's three GEMMs as DeepSeek-V3 (section 3.3) quantizes them, in
    float64: each GEMM's operands in tiles along the dimension it sums over. Forward y = x w sums over
    the features: x in 1 x n tiles, w in n x n blocks. dx = g w^T sums over the output features: g in
    1 x n, the same w. dW = x^T g sums over the tokens: both in n x 1 tiles -- x read back from its
    stored FP8 (the forward's 1 x n), dequantized and re-quantized; g from its fp32 values."""
    qx, qw = tiles(x, "e4m3", 1, n), tiles(w, "e4m3", n, n)
    qx_t, qg_t = tiles(qx, "e4m3", n, 1), tiles(g, "e5m2", n, 1)
    return {"y": (qx, qw), "dx": (tiles(g, "e5m2", 1, n), qw.T), "dw": (qx_t.T, qg_t)}


def deepseek_block_step(x, w, b, g, n):
    """y, dx, dw, db of that reference."""
    ops = deepseek_block_operands(x, w, g, n)
    return ops["y"][0] @ ops["y"][1] + b, ops["dx"][0] @ ops["dx"][1], ops["dw"][0] @ ops["dw"][1], g.sum(0)


def outliers(rng, rows, cols, n, fmt):
    """Values around 1 with an outlier in some tiles (2^13 for e4m3's 18 binades, 2^30 for e5m2's 32):
    an outlier's tile scale sends the small values of its tile below the format's normal range, so
    which tiles group which values shows."""
    a = rng.choice([-1, 1], (rows, cols)) * 2.0 ** rng.integers(-6, 3, (rows, cols))
    for _ in range(max(1, rows * cols // (4 * n))):
        a[rng.integers(rows), rng.integers(cols)] = 2.0 ** (13 if fmt == "e4m3" else 30)
    return a.astype(np.float32)


@given(rows=st.integers(1, 20), cols=st.integers(1, 20), out=st.integers(1, 12), n=st.sampled_from([2, 4, 8]),
       seed=st.integers(0, 2 ** 31))
@settings(max_examples=30, deadline=None)
def test_block_scaling_tiles_each_gemm_along_what_it_sums_as_deepseek_v3(rows, cols, out, n, seed):
    """The FP8 layer's y, dx and dW equal the reference written from the DeepSeek-V3 report (above),
    ragged edges included, with outliers that make each tiling matter."""
    rng = np.random.default_rng(seed)
    x, w, g = outliers(rng, rows, cols, n, "e4m3"), outliers(rng, cols, out, n, "e4m3"), \
        outliers(rng, rows, out, n, "e5m2")
    layer = fp8_linear(Linear(cols, out, bias=False), Fp8Recipe("block", block=n))
    layer.weight.data = w
    xt = Tensor(x, requires_grad=True)
    y = layer(xt)
    y.backward(g)
    ops = deepseek_block_operands(*(a.astype(np.float64) for a in (x, w, g)), n)
    for got, what in ((y.data, "y"), (xt.grad, "dx"), (layer.weight.grad, "dw")):
        a, b = ops[what]
        k, u = a.shape[1], 2.0 ** -24  # fp32 sums of k exact products: gamma_k |a| |b| (as above)
        bound = k * u / (1 - k * u) * (np.abs(a) @ np.abs(b))
        assert np.all(np.abs(got - a @ b) <= bound * (1 + 1e-6)), what


def test_the_weight_gradients_tiles_turn_a_hand_made_case():
    """One 8 x 8 tile each way (n = 4 over 8 rows, 8 features, 1 output). x[5, 0] = 2^13: its forward
    row tile (x[5, 0:4], scale 2^13 / 448 -> 32, smallest step 32 * 2^-9 = 1/16) flushes x[5, 1] = 1/64
    to 0, and its weight-gradient column tile (x[4:8, 0]) flushes x[6, 0] = 1/64; the FP8 layer must do
    both (DeepSeek-V3's order), not reuse the forward's tiles nor re-quantize the fp32 input."""
    x = np.ones((8, 8), np.float32)
    x[5, 0], x[5, 1], x[6, 0] = 2.0 ** 13, 1 / 64, 1 / 64
    g = np.ones((8, 1), np.float32)
    layer = fp8_linear(Linear(8, 1, bias=False), Fp8Recipe("block", block=4))
    layer.weight.data = np.ones((8, 1), np.float32)
    xt = Tensor(x, requires_grad=True)
    layer(xt).backward(g)
    dw = layer.weight.grad[:, 0]
    # column 0 over the rows: 1 x 4 rows keep x[6, 0] = 1/64 (its row has no outlier), the 4 x 1 tile
    # x[4:8, 0] flushes it: 1 + 2^13 + 0 + 1 for rows 4..7, 4 for rows 0..3
    assert dw[0] == 4 + 1 + 2 ** 13 + 0 + 1
    # column 1: x[5, 1] = 1/64 was flushed in the forward's row tile: stored as 0, and stays 0 (from the
    # fp32 input, its column tile x[4:8, 1] would keep it: 7 + 1/64)
    assert dw[1] == 7
    assert dw[2] == 8


def test_delayed_scaling_equals_float64_reference_step_by_step():
    check_delayed_against_reference()


def test_a_missed_amax_update_is_caught(monkeypatch):
    monkeypatch.setattr(AmaxHistory, "record", lambda self, amax: None)  # planted: history never grows
    with pytest.raises(AssertionError, match="step 1"):
        check_delayed_against_reference()


@pytest.mark.parametrize("factor", [0.5, 2.0 ** 10])
def test_a_wrong_scale_is_caught(monkeypatch, factor):
    """Planted: a scale one binade too small (amax saturates) or ten too large (small values become
    subnormal). (A power-of-two scale that keeps every value in range changes nothing: that is why
    the scales are powers of two.)"""
    right = fp8mod.pow2_scale
    monkeypatch.setattr(fp8mod, "pow2_scale", lambda amax, fmt, margin=0: right(amax, fmt, margin) * factor)
    with pytest.raises(AssertionError):
        test_fp8_layer_equals_float64_reference_of_the_same_quantization("current")


def test_limited_precision_accumulation_rounds_each_chunk_then_promotes():
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((4, 40)).astype(np.float32), rng.standard_normal((40, 3)).astype(np.float32)
    a = fp8_linear(Linear(40, 3, bias=False), Fp8Recipe("current", accumulate=(16, 7)))
    a.weight.data = w
    got = a(Tensor(x)).data
    qx = round_to_format(x / pow2_scale(np.abs(x).max(), E4M3), E4M3) * pow2_scale(np.abs(x).max(), E4M3)
    qw = round_to_format(w / pow2_scale(np.abs(w).max(), E4M3), E4M3) * pow2_scale(np.abs(w).max(), E4M3)
    want = np.zeros((4, 3), np.float32)
    for k in range(0, 40, 16):  # 7 mantissa bits: the partial sum rounded as bf16 is
        want += (qx[:, k:k + 16] @ qw[k:k + 16]).astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(got, qx @ qw)


# -- composition and refusals ---------------------------------------------------------------------------

def train_fp8(model, batches, recipe, comm=None):
    fp8_linear(model, recipe)
    if comm is not None:
        from minidist.parallel.data.ddp import DDP
        ddp = DDP(model, comm)
    opt, losses = AdamW(model.parameters(), lr=3e-3), []
    for idx in batches:
        loss_fn = getattr(model, "loss_fn", None)
        loss = loss_fn(model(idx), idx) if loss_fn is not None else model.loss(idx, idx)
        if comm is not None:
            ddp.backward(loss)
            ddp.wait_gradients()
        else:
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


def test_ddp_with_block_fp8_trains_as_the_serial_fp8_model():
    """1 x b activation tiles are per token and the weight tiles are the same on every replica, so a
    data-parallel run quantizes exactly what the serial run on the whole batch does."""
    rng = np.random.default_rng(0)
    data = [rng.integers(0, 32, (4, 16)) for _ in range(3)]
    recipe = Fp8Recipe("block", block=16)
    _, serial = train_fp8(GPT(CFG), data, recipe)

    def body(comm):
        _, m = train_fp8(GPT(CFG), [d[2 * comm.rank:2 * comm.rank + 2] for d in data], recipe, comm)
        return [np.array(p.data) for p in m.parameters()]
    for got in run(body, ranks=2):
        for a, b in zip(got, serial.parameters()):
            np.testing.assert_allclose(a, b.data, atol=2e-5)


def test_tensor_parallel_fp8_reduces_amaxes_and_matches_serial_fp8():
    """Every shard quantizes with the whole tensor's scale (the amaxes max-reduced over the group):
    each layer's last scales on every rank equal the serial FP8 model's, and so do the losses."""
    from minidist.parallel.tensor.gpt import TPGPT

    data = [np.random.default_rng(s).integers(0, 32, (2, 16)) for s in range(3)]
    want, serial = train_fp8(GPT(CFG), data, "current")
    serial_scales = {n: dict(q.last) for n, q in fp8_quantizers(serial).items()}

    def body(comm):
        losses, model = train_fp8(TPGPT(CFG, comm), data, "current")
        named = dict(model.named_modules())
        kinds = sorted({type(named[n + "."]).__name__ for n in fp8_quantizers(model)})
        return losses, kinds, {n: dict(q.last) for n, q in fp8_quantizers(model).items()}
    for losses, kinds, scales in run(body, ranks=2):
        np.testing.assert_allclose(losses, want, rtol=1e-4)
        assert kinds == ["ColumnParallelLinear", "RowParallelLinear"]
        assert scales == serial_scales


def test_fp8_refuses_what_it_cannot_wrap_naming_both():
    """Which techniques FP8 joins is parallelize's table (tests/parallel/test_compose.py); by hand,
    autocast and FP8 both want a Linear's innermost wrapper, and the second is refused naming both."""
    from minidist.parallel.memory.precision import autocast

    class Stage:  # a pipeline stage is no Module
        chunks, num_stages = [], 2

    with pytest.raises(ValueError, match=r"'autocast' forward wrapper \(from autocast \(bfloat16\)\); "
                                         r"fp8_linear cannot add a second one"):
        fp8_linear(autocast(GPT(CFG), "bf16"))
    with pytest.raises(ValueError, match="fp8_linear needs a Module .*not a Stage"):
        fp8_linear(Stage())
    with pytest.raises(ValueError, match="fp8_linear needs a Module .*not a list"):
        fp8_linear([])
    with pytest.raises(ValueError, match=r"'autocast' forward wrapper \(from fp8_linear\); autocast "
                                         r"\(bfloat16\) cannot add a second one"):
        autocast(fp8_linear(GPT(CFG)), "bf16")  # the other order
    with pytest.raises(ValueError, match="scaling='e4m3'.*current, delayed, block"):
        Fp8Recipe("e4m3")
    with pytest.raises(ValueError, match="accumulate"):
        Fp8Recipe(accumulate=(128,))
    x = Tensor(np.ones((2, 3), np.float64))
    with pytest.raises(ValueError, match="float32"):
        fp8_linear(Linear(3, 2, dtype=np.float64))(x)


def test_remove_fp8_restores_the_fp32_product():
    layer = Linear(8, 4)
    x = Tensor(np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32))
    dense = layer(x).data
    fp8_linear(layer, "current")
    assert not np.array_equal(layer(x).data, dense)
    np.testing.assert_array_equal(remove_fp8(layer)(x).data, dense)


# -- the FP8 all-reduce hook -------------------------------------------------------------------------------

@pytest.mark.parametrize("p,n", [(2, 1000), (3, 1001), (4, 7)])
def test_fp8_all_reduce_bytes_and_sum(p, n):
    def body(comm):
        x = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
        with measure(comm) as m:
            out = reduce_with_hook(comm, *make_hook("fp8"), x)
        return out, m.bytes_sent, x
    res = run(body, ranks=p)
    exact = sum(r[2] for r in res)
    sizes = [n // p + (j < n % p) for j in range(p)]
    for r, (out, sent, _) in enumerate(res):
        # all-to-all: codes + a 4-byte scale to each peer; ring all-gather: every chunk but rank r+1's
        want = sum(s + 4 for j, s in enumerate(sizes) if j != r) + sum(sizes) + 4 * p - sizes[(r + 1) % p] - 4
        assert sent == want
        np.testing.assert_array_equal(out, res[0][0])  # identical on every rank
    # two e4m3 roundings (send, reduced chunk), each within 2^-4 of the amax it is scaled to, per chunk
    amax = max(np.abs(r[2]).max() for r in res)
    assert np.abs(res[0][0] - exact).max() <= p * amax / 16 + np.abs(exact).max() / 16 + 1e-6


def test_ddp_with_the_fp8_hook_trains_within_3_percent_of_dense():
    from minidist.parallel.data.ddp import DDP

    rng = np.random.default_rng(0)
    data = [rng.integers(0, 32, (4, 16)) for _ in range(12)]

    def body(comm, hook):
        model = GPT(CFG)
        ddp = DDP(model, comm, bucket_bytes=20000)
        if hook:
            ddp.register_comm_hook(*make_hook(hook))
        opt = AdamW(model.parameters(), lr=3e-3)
        for d in data:
            x = d[2 * comm.rank:2 * comm.rank + 2]
            loss = model.loss(x, x)
            ddp.backward(loss)
            ddp.wait_gradients()
            opt.step()
            opt.zero_grad()
        return loss.item()
    dense, fp8 = run(body, ranks=2, hook=None), run(body, ranks=2, hook="fp8")
    assert abs(np.mean(fp8) - np.mean(dense)) <= 0.03 * np.mean(dense)
    assert np.mean(fp8) != np.mean(dense)


def test_the_estimates_count_fp8_bytes_and_its_peak():
    from minidist.parallel.data.compress.fp8 import fp8_bytes_sent
    from minidist.plan import estimates as E
    from minidist.plan.hardware import PRESETS

    for n, p in ((1000, 2), (4096, 8), (12, 4)):  # n divisible by p: every chunk n/p codes + 4 bytes
        assert E.fp8_all_reduce_bytes(n, p) == 2 * (p - 1) * (n // p + 4) == fp8_bytes_sent(n, p)
    assert E.peak_flops(PRESETS["h100"], "fp8") == 1979e12 == 2 * 989.5e12
    assert E.peak_flops(PRESETS["b200"], "fp8") == 2 * PRESETS["b200"].peak_flops
    with pytest.raises(ValueError, match="TPU v4 lists no FP8 peak"):
        E.peak_flops(PRESETS["tpu-v4"], "fp8")
    assert E.training_memory(1.0, "fp8")["total"] == 16


@pytest.mark.parametrize("scaling", ["delayed", "block"])
def test_the_fp8_layer_on_jax_arrays_equals_numpy(scaling):
    from minidist.accel.backend import get_backend, to_host

    rng = np.random.default_rng(0)
    x, g = rng.standard_normal((5, 12)).astype(np.float32), rng.standard_normal((5, 6)).astype(np.float32)
    out = []
    for name in ("numpy", "jax"):
        be = get_backend(name)
        layer = Linear(12, 6, rng=np.random.default_rng(1), backend=name)
        fp8_linear(layer, Fp8Recipe(scaling, block=4))
        got = layer_step(layer, be.from_host(x), be.from_host(g))
        out.append([to_host(a) for a in got])
    for a, b in zip(*out):
        np.testing.assert_array_equal(a, b)


def test_fp8_imports_no_tensor_parallelism_and_finds_its_layers_by_their_forward():
    """FP8 recognises a Linear-like layer by ``forward(x, product=None)``, so it imports none of the
    tensor-parallel layers (nor any technique, nor the composition layer)."""
    import ast
    from pathlib import Path

    from minidist.parallel.tensor.layers import ColumnParallelLinear, ParallelMLP, RowParallelLinear

    tree = ast.parse(Path(fp8mod.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {m for m in imported if m and m.startswith("minidist.parallel")
                and not m.startswith("minidist.parallel.memory.fp8")}, imported
    assert fp8mod.is_linear_like(Linear(2, 2))
    assert fp8mod.is_linear_like(ColumnParallelLinear.__new__(ColumnParallelLinear))
    assert fp8mod.is_linear_like(RowParallelLinear.__new__(RowParallelLinear))
    assert not fp8mod.is_linear_like(ParallelMLP.__new__(ParallelMLP))


# -- an overflow is reported and its step skipped, never saturated away (issue 40) ---------------------------

@pytest.mark.parametrize("scaling", ["current", "delayed", "block"])
@pytest.mark.parametrize("where", ["x", "g"])
def test_inf_in_activations_or_gradients_reaches_the_product_and_is_noted(scaling, where):
    """An inf in the input activations (or the output gradients) is not saturated to ±max: the product
    is not finite, and the layer notes which operand met it."""
    rng = np.random.default_rng(0)
    layer = fp8_linear(Linear(8, 4, bias=False), Fp8Recipe(scaling, block=4))
    x, g = rng.standard_normal((3, 8)).astype(np.float32), rng.standard_normal((3, 4)).astype(np.float32)
    (x if where == "x" else g)[1, 2] = np.inf
    xt = Tensor(x, requires_grad=True)
    y = layer(xt)
    y.backward(g)
    assert not np.isfinite(layer.weight.grad).all()
    if where == "x":
        assert not np.isfinite(y.data).all()
    else:
        assert np.isfinite(y.data).all() and not np.isfinite(xt.grad).all()
    assert where in fp8_quantizers(layer)[""].nonfinite


def test_an_inf_amax_never_enters_the_delayed_history():
    """Delayed scaling, history 4: one step whose gradients hold an inf, then gradients of 1e-6. The inf
    is not recorded, so the next steps' scale fits 1e-6 (error below e5m2's 2^-3 relative), where a
    recorded inf would have set the scale to 1 for 4 steps and flushed them all to 0 (100% error)."""
    rng = np.random.default_rng(0)
    layer = fp8_linear(Linear(8, 8, bias=False), Fp8Recipe("delayed", history=4))
    x = rng.standard_normal((8, 8)).astype(np.float32)
    for step in range(4):
        g = (rng.standard_normal((8, 8)) * 1e-6).astype(np.float32)
        if step == 0:
            g[0, 0] = np.inf
        layer.weight.grad = None
        xt = Tensor(x, requires_grad=True)
        layer(xt).backward(g)
        hist = fp8_quantizers(layer)[""].history["g"].values
        assert all(np.isfinite(hist)) and len(hist) == step  # the inf step left nothing behind
        if step:
            want = x.astype(np.float64).T @ g
            rel = np.abs(layer.weight.grad - want).max() / np.abs(want).max()
            assert rel < 2 ** -3, (step, rel)
    AmaxHistory(2).record(float("nan"))  # NaN too
    h = AmaxHistory(2)
    h.record(float("nan"))
    assert h.values == []


def _fp8_model_step(model, opt, x):
    loss = ((model(Tensor(x)) * 1.0).sum())
    loss.backward()
    return fp8_step(model, opt)


def test_a_step_that_met_an_inf_is_skipped_with_a_warning_and_the_next_one_trains():
    rng = np.random.default_rng(0)
    layer = fp8_linear(Linear(8, 4), Fp8Recipe("block", block=4))
    opt = AdamW(layer.parameters(), lr=1e-2)
    x = rng.standard_normal((3, 8)).astype(np.float32)
    assert _fp8_model_step(layer, opt, x)
    before = [p.data.copy() for p in layer.parameters()]
    bad = x.copy()
    bad[0, 0] = np.inf
    said = r"FP8: step skipped, a non-finite amax in \(model\) \(input activations\)"
    with pytest.warns(RuntimeWarning, match=said):
        assert not _fp8_model_step(layer, opt, bad)
    assert all(np.array_equal(a, p.data) for a, p in zip(before, layer.parameters()))
    assert all(p.grad is None or not np.any(p.grad) for p in layer.parameters())
    assert _fp8_model_step(layer, opt, x)  # the note was cleared: the next clean step trains
    assert not all(np.array_equal(a, p.data) for a, p in zip(before, layer.parameters()))
    assert all(np.isfinite(p.data).all() for p in layer.parameters())


def test_the_raise_recipe_raises_at_the_layer_naming_it():
    model = fp8_linear(GPT(CFG), Fp8Recipe("current", on_overflow="raise"))
    ids = np.zeros((1, 4), np.int64)
    name, lin = next((n, m) for n, m in model.named_modules() if isinstance(m, Linear))
    lin.weight.data[0, 0] = np.nan
    said = f"FP8 layer {re.escape(name.rstrip('.'))}: its weights hold inf or NaN"
    with pytest.raises(fp8mod.Fp8Overflow, match=said):
        model(ids)
    with pytest.raises(ValueError, match="on_overflow='sometimes'; use 'skip' or 'raise'"):
        Fp8Recipe(on_overflow="sometimes")


def _parallel_fp8_skip(comm):
    from minidist.comm import Mesh
    from minidist.parallel.parallelize import parallelize

    par = parallelize(CFG, Mesh(comm, dp=2), fp8=Fp8Recipe("block", block=4), optimizer="adamw", lr=1e-2)
    name, lin = next((n, m) for n, m in par.model.named_modules() if isinstance(m, Linear))
    if comm.rank == 0:  # one rank's weights go bad: every rank must skip, or the replicas would part
        lin.weight.data[0, 0] = np.inf
    before = {n: p.data.copy() for n, p in par.model.named_parameters()}
    ids = np.random.default_rng(0).integers(0, 32, (4, 16))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        par.step(ids, ids)
    return all(np.array_equal(before[n], p.data, equal_nan=True) for n, p in par.model.named_parameters())


def test_parallelize_skips_an_fp8_step_on_every_rank_when_one_met_an_inf():
    assert run(_parallel_fp8_skip, ranks=2) == [True, True]
