"""The fast forms (minidist/autograd/fused.py) equal the plain ops they stand in for, forward and
backward, on NumPy and on JAX; and ``fused.fast`` is what chooses them.

Bit for bit where the arithmetic is the same operations in the same order: GELU (the plain formula
and the in-place chain apply the same roundings), Linear (the same products; the bias added into
the product's buffer instead of a new one). LayerNorm, attention and cross-entropy sum in another
order (a BLAS matrix-vector product instead of NumPy's pairwise ``sum``; einsum): each sum of n
terms may then differ by ~n ulps of its largest term, so those are compared within ``SLACK`` ulps
(n <= 16 here) of the largest magnitude in the result.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist.accel.backend import get_backend
from minidist.autograd import fused, ops
from minidist.autograd.tensor import Tensor

SLACK = 64  # ulps of the largest magnitude: sums of <= 16 terms in another order, then a few ops
BACKENDS = ["numpy", "jax"]
lead = st.lists(st.integers(1, 3), min_size=1, max_size=3).map(tuple)
floats = st.sampled_from([np.float32, np.float64])


def _backend(name):
    if name == "jax":
        pytest.importorskip("jax")
    return get_backend(name)


def _run(op, backend, arrays, kwargs=None, seed=0):
    """Output and every float input's gradient (for a random upstream gradient) of ``op.apply``."""
    be = _backend(backend)
    inputs = [Tensor(be.from_host(a), requires_grad=True) if a.dtype.kind == "f" else a for a in arrays]
    out = op.apply(*inputs, **(kwargs or {}))
    g = np.random.default_rng(seed).standard_normal(out.shape).astype(out.dtype)
    out.backward(be.from_host(g))
    return [out.numpy()] + [t.grad for t in inputs if isinstance(t, Tensor)]


def _host(a):
    return np.asarray(a.numpy() if isinstance(a, Tensor) else a)


def check(plain, fast, backend, arrays, kwargs=None, exact=False):
    """``fast`` (fused.X) gives ``plain``'s (ops.X) output and gradients: the same bits, or within SLACK."""
    assert fast is fused.FAST[plain] and issubclass(fast, plain) and fast.__name__ == plain.__name__
    want, got = _run(plain, backend, arrays, kwargs), _run(fast, backend, arrays, kwargs)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        a, b = _host(a), _host(b)
        assert a.dtype == b.dtype and a.shape == b.shape, (i, a.dtype, b.dtype, a.shape, b.shape)
        if exact:
            np.testing.assert_array_equal(a, b, err_msg=f"{fast.__name__} output/gradient {i} on {backend}")
        else:
            largest = float(np.abs(b.astype(np.float64)).max(initial=0))
            bound = SLACK * np.finfo(b.dtype).eps * max(1.0, largest)
            np.testing.assert_allclose(a, b, rtol=0, atol=bound,
                                       err_msg=f"{fast.__name__} output/gradient {i} on {backend}")


def _rand(seed, *shapes, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


@pytest.mark.parametrize("backend", BACKENDS)
@given(shape=lead, dtype=floats, seed=st.integers(0, 2 ** 16))
def test_gelu(backend, shape, dtype, seed):
    (x,) = _rand(seed, shape, dtype=dtype)
    check(ops.Gelu, fused.Gelu, backend, [x * 3], exact=True)


@pytest.mark.parametrize("backend", BACKENDS)
@given(shape=lead, k=st.integers(1, 16), n=st.integers(1, 8), bias=st.booleans(), dtype=floats,
       seed=st.integers(0, 2 ** 16))
def test_linear(backend, shape, k, n, bias, dtype, seed):
    arrays = _rand(seed, shape + (k,), (k, n), (n,), dtype=dtype)
    check(ops.Linear, fused.Linear, backend, arrays if bias else arrays[:2], exact=backend == "numpy")


@pytest.mark.parametrize("backend", BACKENDS)
@given(shape=lead, k=st.integers(1, 16), n=st.integers(1, 8), seed=st.integers(0, 2 ** 16))
def test_linear_of_fp16_weights_computed_in_fp32(backend, shape, k, n, seed):
    arrays = _rand(seed, shape + (k,), (k, n), (n,), dtype=np.float16)
    check(ops.Linear, fused.Linear, backend, arrays, {"compute": np.dtype(np.float32)},
          exact=backend == "numpy")


@pytest.mark.parametrize("backend", BACKENDS)
@given(shape=lead, n=st.integers(2, 16), dtype=floats, compute=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_layer_norm(backend, shape, n, dtype, compute, seed):
    x, w, b = _rand(seed, shape + (n,), (n,), (n,), dtype=np.float16 if compute else dtype)
    kwargs = {"eps": 1e-5, "compute": np.dtype(np.float32)} if compute else {"eps": 1e-5}
    check(ops.LayerNorm, fused.LayerNorm, backend, [x * 2 + 1, w, b], kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
@given(b=st.integers(1, 2), h=st.integers(1, 3), tq=st.integers(1, 6), extra=st.integers(0, 3),
       d=st.integers(1, 8), causal=st.booleans(), dtype=floats, seed=st.integers(0, 2 ** 16))
def test_scaled_dot_product_attention(backend, b, h, tq, extra, d, causal, dtype, seed):
    arrays = _rand(seed, (b, h, tq, d), (b, h, tq + extra, d), (b, h, tq + extra, d), dtype=dtype)
    check(ops.ScaledDotProductAttention, fused.ScaledDotProductAttention, backend, arrays, {"causal": causal})


@pytest.mark.parametrize("backend", BACKENDS)
@given(b=st.integers(1, 2), t=st.integers(1, 6), h=st.integers(1, 3), d=st.integers(1, 6),
       causal=st.booleans(), dtype=floats, seed=st.integers(0, 2 ** 16))
def test_packed_attention(backend, b, t, h, d, causal, dtype, seed):
    (qkv,) = _rand(seed, (b, t, 3 * h * d), dtype=dtype)
    check(ops.PackedAttention, fused.PackedAttention, backend, [qkv], {"n_head": h, "causal": causal})


@pytest.mark.parametrize("backend", BACKENDS)
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=2).map(tuple), v=st.integers(2, 16),
       dtype=floats, seed=st.integers(0, 2 ** 16))
def test_cross_entropy(backend, shape, v, dtype, seed):
    (logits,) = _rand(seed, shape + (v,), dtype=dtype)
    targets = np.random.default_rng(seed).integers(-1, v, shape)  # -1: ignored
    check(ops.CrossEntropy, fused.CrossEntropy, backend, [logits * 3, targets], {"ignore_index": -1})


# -- the one mechanism that chooses ------------------------------------------------------------

def test_fast_picks_the_fused_form_on_numpy_and_the_plain_one_when_disabled():
    x = np.ones((2, 3))
    assert all(fused.fast(plain, x) is fast for plain, fast in fused.FAST.items())
    assert fused.fast(ops.Gelu, Tensor(x)) is fused.Gelu and fused.fast(ops.Add, x) is ops.Add
    with fused.disabled():
        assert not fused.enabled() and all(fused.fast(plain, x) is plain for plain in fused.FAST)
    assert fused.enabled()


def test_importing_minidist_registers_the_fast_forms():
    """The registry lives in ``ops`` and ``fused`` fills it: a program that imports only ``ops`` (and so
    the ``minidist`` package, which imports ``fused``) gets every fast form, and no import cycle."""
    code = ("import numpy as np\nfrom minidist.autograd import ops\n"
            "from minidist.autograd.tensor import Tensor\n"
            "y = ops.gelu(Tensor(np.ones(3), requires_grad=True))\n"
            "print(len(ops.FAST), y._node.fn is ops.FAST[ops.Gelu], ops.FAST[ops.Gelu].__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    assert out.split() == ["6", "True", "minidist.autograd.fused"], out
    assert fused.FAST is ops.FAST and fused.fast is ops.fast and fused.disabled is ops.disabled


def test_on_jax_the_plain_form_runs():
    """XLA fuses a plain formula into one program by itself, and a JAX array has no buffer to update."""
    be = _backend("jax")
    x = Tensor(be.from_host(np.ones((2, 3))))
    assert all(fused.fast(plain, x) is plain for plain in fused.FAST)


def _graph_ops(t):
    seen, stack, found = set(), [t._node], set()
    while stack:
        node = stack.pop()
        if node is None or isinstance(node, Tensor) or id(node) in seen:
            continue
        seen.add(id(node))
        found.add(node.fn)
        stack.extend(node.parents)
    return found


def test_a_model_gets_the_fast_forms_by_default_and_the_same_loss_without_them():
    from minidist.nn import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=11, block_size=6, n_layer=1, n_head=2, d_model=8, dtype="float64"))
    x, y = np.random.default_rng(0).integers(0, 11, (2, 2, 6))
    loss = model.loss(x, y)
    assert set(fused.FAST.values()) - {fused.ScaledDotProductAttention} <= _graph_ops(loss)
    with fused.disabled():
        plain = model.loss(x, y)
    assert not set(fused.FAST.values()) & _graph_ops(plain)
    np.testing.assert_allclose(plain.item(), loss.item(), rtol=1e-13)


def test_the_environment_switch_runs_the_plain_forms():
    code = ("import numpy as np\nfrom minidist.autograd import fused, ops\n"
            "from minidist.autograd.tensor import Tensor\n"
            "y = ops.gelu(Tensor(np.ones(3), requires_grad=True))\n"
            "print(fused.enabled(), y._node.fn is ops.Gelu)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "MINIDIST_FUSED": "0"},
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.split() == ["False", "True"], out
