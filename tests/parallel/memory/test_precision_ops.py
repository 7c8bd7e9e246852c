"""Mixed precision's one-op LayerNorm and Linear (``compute=float32``): the same bits as the casts
around the fp32 op that autocast used to write out (five ops for a LayerNorm, five for a Linear),
within rounding of a float64 reference written out here, gradients in their inputs' dtypes, on
NumPy and JAX; and what an autocast model dispatches."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist.accel.backend import get_backend, to_host
from minidist.autograd import ops
from minidist.autograd.tensor import Tensor
from minidist.nn.gpt import GPT, GPTConfig
from minidist.nn.layers import LayerNorm, Linear
from minidist.nn.module import Sequential
from minidist.nn.optim import AdamW
from minidist.parallel.memory.precision import DynamicLossScaler, MixedPrecision, has_inf_or_nan
from tests.conftest import backends

BF16, F16, F32, F64 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.float32, np.float64
LOW = [BF16, F16]
ULP = {BF16: 2.0 ** -7, F16: 2.0 ** -10}  # the spacing of numbers in [1, 2)
EPS = 1e-5


def _arrays(seed, shapes, low, offset=0.0):
    """Random low-precision arrays (values a low dtype holds exactly), x shifted by ``offset``: a
    large mean is what low-precision statistics get wrong."""
    rng = np.random.default_rng(seed)
    out = [rng.standard_normal(s).astype(F32) for s in shapes]
    out[0] = out[0] + np.float32(offset)
    return [a.astype(low) for a in out]


def _run(fn, backend, arrays, g):
    """fn of Tensors of ``arrays`` on ``backend`` and its backward of ``g``: (output, gradients) on
    the host, in the dtypes they came in."""
    be = get_backend(backend)
    ts = [Tensor(be.from_host(a), requires_grad=True) for a in arrays]
    y = fn(*ts)
    y.backward(be.from_host(g))
    return np.asarray(to_host(y.data)), [np.asarray(to_host(t.grad)) for t in ts]


def _assert_same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))


def _assert_rounded_from(ours, ref, low, scale=None):
    """``ours`` (low precision) is ``ref`` (float64) rounded: within 1 ulp of the low dtype, plus the
    float32 arithmetic's rounding on a scale of ``scale`` (default max |ref|) for results that cancel."""
    assert ours.dtype == low
    scale = np.abs(ref).max() if scale is None else scale
    tol = ULP[low] * np.abs(ref) + 8 * 2.0 ** -23 * scale + 1e-30
    err = np.abs(ours.astype(F64) - ref)
    assert (err <= tol).all(), f"max error {err.max():.3g} where the tolerance is {tol[err > tol].min():.3g}"


# ---------------------------------------------------------------------------------------------
# LayerNorm
# ---------------------------------------------------------------------------------------------
def _ln_casts(x, w, b):
    """What autocast's LayerNorm wrapper wrote out: cast up, the fp32 norm, cast the output down."""
    y = ops.layer_norm(ops.cast(x, F32), ops.cast(w, F32), ops.cast(b, F32), EPS)
    return ops.cast(y, w.dtype)


def _ln_reference(x, w, b, g):
    """LayerNorm and its gradients in float64, written out: (y, gx, gw, gb)."""
    x, w, b, g = (a.astype(F64) for a in (x, w, b, g))
    xc = x - x.mean(-1, keepdims=True)
    rstd = 1 / np.sqrt((xc * xc).mean(-1, keepdims=True) + EPS)
    xhat = xc * rstd
    d = g * w
    gx = rstd * (d - d.mean(-1, keepdims=True) - xhat * (d * xhat).mean(-1, keepdims=True))
    rows = (-1, x.shape[-1])
    return xhat * w + b, gx, (g * xhat).reshape(rows).sum(0), g.reshape(rows).sum(0)


@pytest.mark.parametrize("low", LOW, ids=["bf16", "fp16"])
@given(rows=st.integers(1, 6), dim=st.integers(2, 40), offset=st.sampled_from([0.0, 3.0, -40.0]),
       seed=st.integers(0, 2 ** 16))
def test_layer_norm_with_fp32_statistics_is_the_casts_around_it_in_one_op(low, rows, dim, offset, seed):
    check_layer_norm("numpy", low, rows, dim, offset, seed)


@pytest.mark.parametrize("backend", [b for b in backends() if b != "numpy"])  # (a program per shape)
@pytest.mark.parametrize("low", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("rows, dim, offset", [(3, 40, -40.0), (1, 2, 0.0)])
def test_layer_norm_with_fp32_statistics_on_devices(backend, low, rows, dim, offset):
    check_layer_norm(backend, low, rows, dim, offset, seed=7)


def check_layer_norm(backend, low, rows, dim, offset, seed):
    x, w, b, g = _arrays(seed, [(rows, dim), (dim,), (dim,), (rows, dim)], low, offset)
    one = _run(lambda *t: ops.layer_norm(*t, EPS, compute=F32), backend, [x, w, b], g)
    five = _run(_ln_casts, backend, [x, w, b], g)
    for ours, theirs in zip([one[0], *one[1]], [five[0], *five[1]]):
        _assert_same_bits(ours, theirs)  # output and every gradient: low dtype, the same bits
    y, gx, gw, gb = _ln_reference(x, w, b, g)
    _assert_rounded_from(one[0], y, low)
    # gx is rstd times sums of g·w, and fp32's rounding of x's mean (of size |x|) is magnified by
    # rstd in x̂: a large offset over a small spread (bf16's coarse steps) is ill-conditioned
    rstd = 1 / np.sqrt(x.astype(F64).var(-1) + EPS)
    cond = 1 + np.abs(x.astype(F64)).max() * rstd.max()
    gw_max = np.abs(g.astype(F64) * w.astype(F64)).max()
    _assert_rounded_from(one[1][0], gx, low, scale=rstd.max() * gw_max * dim * cond)
    _assert_rounded_from(one[1][1], gw, low, scale=np.abs(g.astype(F64)).max() * 4 * rows)
    _assert_rounded_from(one[1][2], gb, low, scale=np.abs(g.astype(F64)).max() * rows)


@pytest.mark.parametrize("backend", backends())
def test_layer_norm_compute_keeps_each_gradient_in_its_inputs_dtype(backend):
    """Statistics in fp32 whatever comes in: an fp32 residual stream with bf16 parameters gives a bf16
    output (the parameters' dtype), an fp32 input gradient and bf16 parameter gradients."""
    x, w, b, g = _arrays(3, [(4, 8), (8,), (8,), (4, 8)], BF16, offset=5.0)
    y, (gx, gw, gb) = _run(lambda *t: ops.layer_norm(*t, EPS, compute=F32), backend, [x.astype(F32), w, b], g)
    assert (y.dtype, gx.dtype, gw.dtype, gb.dtype) == (BF16, F32, BF16, BF16)
    ref = _ln_reference(x, w, b, g)
    _assert_rounded_from(y, ref[0], BF16)
    np.testing.assert_allclose(gx, ref[1], rtol=1e-4, atol=1e-4 * np.abs(ref[1]).max())


# ---------------------------------------------------------------------------------------------
# Linear
# ---------------------------------------------------------------------------------------------
def _linear_casts(x, w, b=None):
    """What ``ops.linear`` of 2-byte weights wrote out: every input cast up, the fp32 product, cast down."""
    args = (ops.cast(x, F32), ops.cast(w, F32)) + (() if b is None else (ops.cast(b, F32),))
    return ops.cast(ops.Linear.apply(*args), w.dtype)


@pytest.mark.parametrize("low", LOW, ids=["bf16", "fp16"])
@given(lead=st.lists(st.integers(1, 4), min_size=1, max_size=2).map(tuple), k=st.integers(1, 24),
       n=st.integers(1, 24), bias=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_linear_of_low_precision_weights_is_the_casts_around_it_in_one_op(low, lead, k, n, bias, seed):
    check_linear("numpy", low, lead, k, n, bias, seed)


@pytest.mark.parametrize("backend", [b for b in backends() if b != "numpy"])
@pytest.mark.parametrize("low", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("lead, k, n, bias", [((2, 3), 24, 7, True), ((1,), 1, 5, False)])
def test_linear_of_low_precision_weights_on_devices(backend, low, lead, k, n, bias):
    check_linear(backend, low, lead, k, n, bias, seed=11)


def check_linear(backend, low, lead, k, n, bias, seed):
    shapes = [lead + (k,), (k, n)] + ([(n,)] if bias else []) + [lead + (n,)]
    *arrays, g = _arrays(seed, shapes, low)
    one = _run(ops.linear, backend, arrays, g)
    five = _run(_linear_casts, backend, arrays, g)
    for ours, theirs in zip([one[0], *one[1]], [five[0], *five[1]]):
        _assert_same_bits(ours, theirs)
    x, w = (a.astype(F64) for a in arrays[:2])
    g64, rows = g.astype(F64), (-1, n)
    y = x @ w + (arrays[2].astype(F64) if bias else 0)
    # every product accumulates k (or the rows) fp32 terms: scale the slack by the sum of |terms|
    _assert_rounded_from(one[0], y, low, scale=(np.abs(x) @ np.abs(w)).max() * 4)
    _assert_rounded_from(one[1][0], g64 @ w.T, low, scale=(np.abs(g64) @ np.abs(w.T)).max() * 4)
    xr, gr = x.reshape(-1, k), g64.reshape(rows)
    _assert_rounded_from(one[1][1], xr.T @ gr, low, scale=(np.abs(xr.T) @ np.abs(gr)).max() * 4)
    if bias:
        _assert_rounded_from(one[1][2], gr.sum(0), low, scale=np.abs(gr).sum(0).max() * 4)


@pytest.mark.parametrize("backend", backends())
def test_linear_saves_its_low_precision_inputs_not_fp32_copies(backend):
    """Half the saved bytes of the casts' version (which saved the fp32 copies the product read)."""
    be = get_backend(backend)
    arrays = _arrays(1, [(2, 3, 8), (8, 5), (5,)], BF16)
    x, w, b = (Tensor(be.from_host(a), requires_grad=True) for a in arrays)
    y = ops.linear(x, w, b)
    assert y.dtype == BF16
    assert [a.dtype for a in y._node.ctx.saved] == [BF16, BF16]


# ---------------------------------------------------------------------------------------------
# an autocast model: how many casts, and no program per new loss scale
# ---------------------------------------------------------------------------------------------
CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, d_model=16)


@pytest.mark.parametrize("dtype, casts", [("bf16", CFG.n_layer + 1), ("fp16", CFG.n_layer + 1), ("fp32", 0)])
def test_an_autocast_step_casts_only_the_attention_inputs_and_the_logits(monkeypatch, dtype, casts):
    """A low-precision GPT step dispatches one Cast per attention (qkv handed on in fp32) and one for
    the logits; LayerNorm and Linear cast inside themselves; an fp32 "autocast" casts nothing."""
    mp = MixedPrecision(GPT(CFG), dtype)
    seen = []
    apply = ops.Cast.apply.__func__
    counted = classmethod(lambda cls, a, **kw: seen.append(kw) or apply(cls, a, **kw))
    monkeypatch.setattr(ops.Cast, "apply", counted)
    idx = np.random.default_rng(0).integers(0, 32, (2, 8))
    loss = mp.loss(idx, idx)
    mp.backward(loss)
    assert mp.step(AdamW(mp.master_params, lr=1e-3))
    assert len(seen) == casts and all(np.dtype(kw["dtype"]) == F32 for kw in seen)
    assert loss.dtype == F32


def test_has_inf_or_nan_looks_at_every_array_and_skips_missing_ones():
    ok = [np.ones(3, F32), None, np.zeros((2, 2), F16)]
    assert not has_inf_or_nan(ok) and not has_inf_or_nan([]) and not has_inf_or_nan([None])
    for bad in (np.inf, -np.inf, np.nan):
        arrays = ok + [np.array([1.0, bad], F32)]
        assert has_inf_or_nan(arrays) and has_inf_or_nan(arrays[::-1])


def test_a_new_loss_scale_compiles_nothing_on_jax():
    """The fp16 step's unscale takes 1/S as an argument of its one compiled call: after a warm-up, a
    skipped step (S halves) and the steps after it compile no program."""
    pytest.importorskip("jax")
    from minidist.accel import jax_engine

    if not jax_engine.enabled():
        pytest.skip("MINIDIST_JAX_JIT=0: nothing is compiled")
    be = get_backend("jax")
    model = Sequential([Linear(8, 8, backend="jax"), LayerNorm(8, backend="jax")])
    mp = MixedPrecision(model, "fp16", scaler=DynamicLossScaler(growth_interval=100))
    opt = AdamW(mp.master_params, lr=1e-3)
    x = be.from_host(np.random.default_rng(0).standard_normal((4, 8)).astype(F16))
    stepped, scales = [], []
    for step in range(5):
        if step == 2:
            before = jax_engine.compilations()
        mp.backward(ops.mean(ops.cast(model(x), F32) ** 2))
        if step == 2:  # an overflow: skip, halve the scale
            g = np.array(to_host(mp.params[0].grad))
            g.flat[0] = np.inf
            mp.params[0].grad = be.from_host(g)
        scales.append(mp.scale)
        stepped.append(mp.step(opt))
    assert stepped == [True, True, False, True, True]
    assert scales == [2.0 ** 16] * 3 + [2.0 ** 15] * 2
    assert jax_engine.compilations() == before


@pytest.mark.parametrize("compute", [np.int8, "float16", "f32x"])
def test_layer_norm_refuses_a_compute_dtype_that_is_not_a_wide_enough_float(compute):
    """An integer, or a float the inputs don't cast to without loss, would compute the statistics in
    garbage (int8 ran and returned wrong numbers; float16 from bf16 turned 1e5 into inf and NaNs
    out, though both are 2 bytes); an unknown name raised NumPy's error naming no argument."""
    x = Tensor(np.ones((2, 4), np.float32))
    w, b = Tensor(np.ones(4, BF16)), Tensor(np.zeros(4, BF16))
    with pytest.raises((ValueError, TypeError), match="compute"):
        ops.layer_norm(x, w, b, compute=compute)


def test_autocast_layer_norm_of_float64_activations_computes_in_float64():
    """Autocast asks for fp32 statistics; activations wider than that are not narrowed for it."""
    from minidist.parallel.memory.precision import autocast

    ln = autocast(LayerNorm(4), "bf16")
    y = ln(Tensor(np.array([[1.0, 2.0, 4.0, 8.0]])))
    assert y.dtype == BF16
    xc = np.array([1.0, 2.0, 4.0, 8.0]) - 3.75
    want = xc / np.sqrt((xc * xc).mean() + 1e-5)  # weight 1, bias 0
    np.testing.assert_array_equal(y.data, want.astype(BF16)[None])
