"""Gradient checks (float64 central differences) for every op, on every backend.

Hypothesis draws shapes, broadcasting patterns and axes; each op's analytic gradient must match
the numerical one to 1e-6. Every test here runs the plain forms of ``minidist.autograd.ops`` (the
textbook formulas); tests/autograd/test_fused.py checks the fast forms against them.
"""

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from minidist.autograd import fused, ops
from minidist.autograd.gradcheck import gradcheck
from tests.conftest import backends

BACKENDS = backends()


@pytest.fixture(autouse=True, scope="module")
def _plain_forms():
    """The public ops (``ops.gelu``, ``ops.layer_norm``, ...) run their plain classes in this module."""
    with fused.disabled():
        yield
F64 = np.float64

shapes = st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple)


def rand(rng, shape, low=None):
    a = rng.standard_normal(shape)
    return np.abs(a) + 0.5 if low == "positive" else a


@st.composite
def broadcast_pair(draw):
    """Two shapes that broadcast: some axes of one are 1 or missing, either side."""
    shape = draw(shapes)
    other = tuple(1 if draw(st.booleans()) else n for n in shape)
    other = other[draw(st.integers(0, len(other) - 1)):]
    return (shape, other) if draw(st.booleans()) else (other, shape)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "pow"])
@given(pair=broadcast_pair(), seed=st.integers(0, 2**16))
@example(pair=((), (3,)), seed=0)        # a 0-d array against a vector
@example(pair=((0, 3), (3,)), seed=0)    # 0-size, broadcast
@example(pair=((2, 0), (1, 0)), seed=0)
def test_binary_broadcasting(backend, op, pair, seed):
    rng = np.random.default_rng(seed)
    a = rand(rng, pair[0], "positive" if op == "pow" else None)
    b = rand(rng, pair[1], "positive" if op == "div" else None)
    fn = {"add": lambda x, y: x + y, "sub": lambda x, y: x - y, "mul": lambda x, y: x * y,
          "div": lambda x, y: x / y, "pow": lambda x, y: x ** y}[op]
    gradcheck(fn, [a, b], backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["exp", "log", "tanh", "relu", "gelu", "neg", "square", "scalar"])
@given(shape=shapes, seed=st.integers(0, 2**16))
@example(shape=(), seed=0)
@example(shape=(0,), seed=0)
@example(shape=(2, 0), seed=0)
def test_unary(backend, op, shape, seed):
    rng = np.random.default_rng(seed)
    a = rand(rng, shape, "positive" if op == "log" else None)
    if op == "relu":  # keep away from the kink
        a = np.where(np.abs(a) < 0.1, 0.5, a)
    fn = {"exp": ops.exp, "log": ops.log, "tanh": ops.tanh, "relu": ops.relu, "gelu": ops.gelu,
          "neg": lambda x: -x, "square": lambda x: x ** 2, "scalar": lambda x: 3.0 - 2.0 * x / 4.0 + 1}[op]
    gradcheck(fn, [a], backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_max_ties_share_the_gradient_equally(backend):
    """Written-out ties (a numerical check can't judge a tie: max is not differentiable there)."""
    from minidist.accel.backend import get_backend
    from minidist.autograd.tensor import Tensor

    be = get_backend(backend)
    a = np.array([[1.0, 3.0, 3.0, 0.0],
                  [2.0, 2.0, 2.0, 2.0],
                  [5.0, -1.0, 4.0, 2.0]])
    cases = [  # (axis, keepdims, upstream gradient, expected gradient of a)
        (1, False, np.array([6.0, 4.0, 1.0]),
         [[0, 3, 3, 0], [1, 1, 1, 1], [1, 0, 0, 0]]),
        (0, True, np.array([[2.0, 1.0, 4.0, 3.0]]),
         [[0, 1, 0, 0], [0, 0, 0, 1.5], [2, 0, 4, 1.5]]),
        (None, False, np.array(1.0),
         [[0, 0, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]]),
        ((0, 1), False, np.array(2.0),
         [[0, 0, 0, 0], [0, 0, 0, 0], [2, 0, 0, 0]]),
    ]
    for axis, keepdims, g, want in cases:
        t = Tensor(be.from_host(a), requires_grad=True)
        ops.max(t, axis=axis, keepdims=keepdims).backward(Tensor(be.from_host(g)))
        np.testing.assert_allclose(np.asarray(be.to_host(t.grad)), want, atol=0,
                                   err_msg=f"max(axis={axis}, keepdims={keepdims})")
    t = Tensor(be.from_host(np.array([[7.0, 7.0, 7.0]])), requires_grad=True)  # a three-way tie
    ops.max(t).backward()
    np.testing.assert_allclose(np.asarray(be.to_host(t.grad)), [[1 / 3, 1 / 3, 1 / 3]], rtol=1e-15)


@st.composite
def shape_and_axis(draw):
    shape = draw(shapes)
    axis = draw(st.one_of(st.none(), st.integers(-len(shape), len(shape) - 1),
                          st.lists(st.integers(0, len(shape) - 1), min_size=1, unique=True).map(tuple)))
    return shape, axis, draw(st.booleans())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["sum", "mean", "max"])
@given(sak=shape_and_axis(), seed=st.integers(0, 2**16))
@example(sak=((), None, False), seed=0)       # 0-d
@example(sak=((), None, True), seed=0)
@example(sak=((0, 3), 1, False), seed=0)      # 0 rows, reduced over the non-empty axis
@example(sak=((2, 0, 3), (0, 2), True), seed=0)
def test_reductions(backend, op, sak, seed):
    shape, axis, keepdims = sak
    a = np.random.default_rng(seed).standard_normal(shape)
    fn = {"sum": ops.sum, "mean": ops.mean, "max": ops.max}[op]
    gradcheck(lambda x: fn(x, axis=axis, keepdims=keepdims), [a], backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@given(batch=st.lists(st.integers(1, 3), max_size=2).map(tuple), m=st.integers(1, 4), k=st.integers(1, 4),
       n=st.integers(1, 4), b_batched=st.booleans(), seed=st.integers(0, 2**16))
@example(batch=(), m=2, k=0, n=3, b_batched=False, seed=0)   # an empty inner axis: the product is zeros
@example(batch=(2,), m=0, k=3, n=2, b_batched=True, seed=0)
@example(batch=(3,), m=2, k=0, n=1, b_batched=False, seed=0)
def test_matmul_batched_and_broadcast(backend, batch, m, k, n, b_batched, seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(batch + (m, k))
    b = rng.standard_normal((batch if b_batched else ()) + (k, n))
    gradcheck(ops.matmul, [a, b], backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["vec_mat", "mat_vec", "vec_vec", "empty_dot"])
def test_matmul_vectors(backend, kind):
    rng = np.random.default_rng(1)
    a, b = {"vec_mat": (rng.standard_normal(3), rng.standard_normal((2, 3, 4))),
            "mat_vec": (rng.standard_normal((2, 4, 3)), rng.standard_normal(3)),
            "vec_vec": (rng.standard_normal(3), rng.standard_normal(3)),  # a dot product: 0-d output
            "empty_dot": (np.zeros(0), np.zeros(0))}[kind]
    gradcheck(ops.matmul, [a, b], backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["vec_mat", "mat_vec", "mat_mat", "vec_vec"])
@pytest.mark.parametrize("wanted", [0, 1])
def test_matmul_with_one_side_constant(backend, kind, wanted):
    """Only input ``wanted`` wants a gradient, the other is a plain array (not saved for backward):
    its gradient is the one it gets when both want one (``t @ np.ones(...)`` used to fail)."""
    from minidist.accel.backend import get_backend
    from minidist.autograd.tensor import Tensor

    be, rng = get_backend(backend), np.random.default_rng(3)
    shapes = {"vec_mat": ((3,), (2, 3, 4)), "mat_vec": ((2, 4, 3), (3,)), "mat_mat": ((2, 3), (3, 4)),
              "vec_vec": ((3,), (3,))}[kind]
    a, b = (be.from_host(rng.standard_normal(s)) for s in shapes)
    both = [Tensor(a, requires_grad=True), Tensor(b, requires_grad=True)]
    (both[0] @ both[1]).sum().backward()
    one = [a, b]
    one[wanted] = Tensor(one[wanted], requires_grad=True)
    (one[0] @ one[1] if wanted == 0 else a @ one[1]).sum().backward()
    np.testing.assert_allclose(be.to_host(one[wanted].grad), be.to_host(both[wanted].grad), rtol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_number_to_the_power_of_a_tensor(backend):
    """``2.0 ** t`` (``Tensor.__rpow__``): d/dt 2^t = 2^t ln 2, checked by finite differences."""
    from minidist.accel.backend import get_backend
    from minidist.autograd.tensor import Tensor

    a = np.random.default_rng(2).standard_normal((2, 3))
    gradcheck(lambda x: 2.0 ** x, [a], backend=backend)
    gradcheck(lambda x: 0.5 ** (x * x), [a], backend=backend)
    t = Tensor(get_backend(backend).from_host(np.array([0.0, 1.0, 3.0], np.float32)), requires_grad=True)
    y = 2.0 ** t
    assert y.dtype == np.float32  # a Python number never widens the tensor's dtype
    np.testing.assert_allclose(y.numpy(), [1.0, 2.0, 8.0])
    y.sum().backward()
    assert t.grad.dtype == np.float32
    np.testing.assert_allclose(get_backend(backend).to_host(t.grad), np.array([1.0, 2.0, 8.0]) * np.log(2.0),
                               rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@given(lead=st.lists(st.integers(1, 3), min_size=1, max_size=2).map(tuple), k=st.integers(1, 4),
       n=st.integers(1, 4), bias=st.booleans(), seed=st.integers(0, 2**16))
@example(lead=(2,), k=0, n=3, bias=True, seed=0)
@example(lead=(0, 2), k=3, n=2, bias=True, seed=0)
def test_linear(backend, lead, k, n, bias, seed):
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(lead + (k,)), rng.standard_normal((k, n))] + \
        ([rng.standard_normal(n)] if bias else [])
    gradcheck(ops.linear, arrays, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@given(shape=st.lists(st.integers(1, 4), min_size=2, max_size=4).map(tuple), data=st.data())
def test_reshape_transpose(backend, shape, data):
    perm = data.draw(st.permutations(range(len(shape))))
    a = np.random.default_rng(0).standard_normal(shape)
    gradcheck(lambda x: ops.transpose(x, perm).reshape(-1, shape[0]), [a], backend=backend)
    gradcheck(lambda x: x.T, [a], backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@given(n=st.integers(2, 6), m=st.integers(1, 4), data=st.data())
def test_indexing(backend, n, m, data):
    a = np.random.default_rng(n).standard_normal((n, m))
    lo = data.draw(st.integers(0, n - 1))
    hi = data.draw(st.integers(lo + 1, n))
    gradcheck(lambda x: x[lo:hi, ::-1], [a], backend=backend)
    gradcheck(lambda x: x[1:, None, 0], [a], backend=backend)
    idx = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=8)))  # repeats add up
    gradcheck(lambda x: x[idx], [a], backend=backend)
    gradcheck(lambda x: x[a[:, 0] > 0], [a], backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@given(sizes=st.lists(st.integers(1, 3), min_size=1, max_size=3), axis=st.integers(0, 1))
def test_concat_split(backend, sizes, axis):
    rng = np.random.default_rng(len(sizes))
    arrays = [rng.standard_normal((s, 2) if axis == 0 else (2, s)) for s in sizes]
    gradcheck(lambda *xs: ops.concat(xs, axis=axis), arrays, backend=backend)
    total = sum(sizes)
    a = rng.standard_normal((total, 3) if axis == 0 else (3, total))
    gradcheck(lambda x: ops.concat([p * (i + 1) for i, p in enumerate(ops.split(x, sizes, axis=axis))],
                                   axis=axis), [a], backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@given(v=st.integers(2, 6), d=st.integers(1, 3), ids=st.lists(st.integers(0, 5), min_size=1, max_size=6))
def test_embedding(backend, v, d, ids):
    idx = np.array([i % v for i in ids]).reshape(1, -1)
    w = np.random.default_rng(v).standard_normal((v, d))
    gradcheck(lambda weight: ops.embedding(weight, idx), [w], backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ids_out_of_range_are_named_on_every_backend(backend):
    """Token ids and targets on the backend's device are range-checked like host ones; on JAX the
    check runs on a host copy: no program compiled (on the device it was ~5 per shape)."""
    from minidist.accel.backend import get_backend
    from minidist.autograd.tensor import Tensor

    be = get_backend(backend)
    w = Tensor(be.from_host(np.ones((5, 3))), requires_grad=True)
    with pytest.raises(ValueError, match=r"holds 7: ids must be in \[0, 5\)"):
        ops.embedding(w, be.from_host(np.array([[0, 7, 1]])))
    logits = Tensor(be.from_host(np.zeros((1, 2, 5))), requires_grad=True)
    with pytest.raises(ValueError, match=r"holds -3: ids must be in \[0, 5\) or -1 \(ignored\)"):
        ops.cross_entropy(logits, be.from_host(np.array([[-1, -3]])))
    if backend == "jax":
        from minidist.accel import jax_engine

        before = jax_engine.compilations()
        ops._check_ids(be.from_host(np.arange(13).reshape(1, 13)), 13, "ids")  # a shape met nowhere else
        assert jax_engine.compilations() == before


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@given(shape=shapes, seed=st.integers(0, 2**16), data=st.data())
def test_softmax(backend, op, shape, seed, data):
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    a = np.random.default_rng(seed).standard_normal(shape)
    fn = ops.softmax if op == "softmax" else ops.log_softmax
    gradcheck(lambda x: fn(x, axis=axis), [a], backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@given(lead=st.lists(st.integers(1, 3), min_size=1, max_size=2).map(tuple), n=st.integers(2, 6),
       seed=st.integers(0, 2**16))
def test_layer_norm(backend, lead, n, seed):
    rng = np.random.default_rng(seed)
    gradcheck(ops.layer_norm, [rng.standard_normal(lead + (n,)), rng.standard_normal(n),
                               rng.standard_normal(n)], backend=backend, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@given(b=st.integers(1, 2), h=st.integers(1, 2), tq=st.integers(1, 4), extra=st.integers(0, 2),
       d=st.integers(1, 3), causal=st.booleans(), seed=st.integers(0, 2**16))
def test_attention(backend, b, h, tq, extra, d, causal, seed):
    rng = np.random.default_rng(seed)
    tk = tq + extra
    q, k, v = (rng.standard_normal((b, h, t, d)) for t in (tq, tk, tk))
    gradcheck(lambda q, k, v: ops.scaled_dot_product_attention(q, k, v, causal=causal), [q, k, v],
              backend=backend, atol=1e-5)


def attention_reference(q, k, v, causal=True):
    """Unfused masked softmax in plain NumPy, one query row at a time: with tq queries and tk >= tq
    keys, query i sits at key position tk - tq + i and sees keys 0 .. tk - tq + i (the KV-cache case)."""
    tq, tk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    out = np.zeros(q.shape[:-1] + (v.shape[-1],))
    for i in range(tq):
        seen = tk - tq + i + 1 if causal else tk
        scores = np.einsum("bhd,bhkd->bhk", q[:, :, i], k[:, :, :seen]) / np.sqrt(d)
        w = np.exp(scores - scores.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        out[:, :, i] = np.einsum("bhk,bhkd->bhd", w, v[:, :, :seen])
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tq,tk,causal", [(5, 5, True), (2, 5, True), (1, 4, True), (3, 6, False)])
def test_attention_matches_unfused(backend, tq, tk, causal):
    from minidist.accel.backend import get_backend
    from minidist.autograd.tensor import Tensor

    be = get_backend(backend)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 3, t, 4)) for t in (tq, tk, tk))
    got = ops.scaled_dot_product_attention(*(Tensor(be.from_host(a)) for a in (q, k, v)), causal=causal)
    np.testing.assert_allclose(got.numpy(), attention_reference(q, k, v, causal), atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@given(n=st.integers(1, 5), v=st.integers(2, 6), seed=st.integers(0, 2**16), ignore=st.booleans())
def test_cross_entropy(backend, n, v, seed, ignore):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((2, n, v))
    targets = rng.integers(0, v, (2, n))
    if ignore:
        targets[0, 0] = -1
    gradcheck(lambda x: ops.cross_entropy(x, targets), [logits], backend=backend)
    # and it is the mean NLL over the valid targets (log-softmax written out in NumPy)
    from minidist.autograd.tensor import Tensor

    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    valid = targets != -1
    expected = -np.take_along_axis(logp, np.where(valid, targets, 0)[..., None], -1)[..., 0][valid].mean()
    assert np.isclose(ops.cross_entropy(Tensor(logits), targets).item(), expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_is_seeded_and_differentiable(backend):
    a = np.random.default_rng(0).standard_normal((4, 5))
    fn = lambda x: ops.dropout(x, 0.3, np.random.default_rng(7))  # noqa: E731
    gradcheck(fn, [a], backend=backend)
    from minidist.autograd.tensor import Tensor

    first, second = fn(Tensor(a)).numpy(), fn(Tensor(a)).numpy()
    np.testing.assert_array_equal(first, second)
    kept = first != 0
    np.testing.assert_allclose(first[kept], a[kept] / 0.7)
    assert 0 < kept.sum() < a.size


@pytest.mark.parametrize("backend", BACKENDS)
def test_cast_keeps_dtypes_explicit(backend):
    a = np.random.default_rng(0).standard_normal((3, 3))
    gradcheck(lambda x: ops.cast(ops.cast(x, np.float32), np.float64), [a], backend=backend, atol=1e-3,
              rtol=1e-3, eps=1e-3)
    from minidist.accel.backend import get_backend
    from minidist.autograd.tensor import Tensor

    t = Tensor(get_backend(backend).from_host(a.astype(np.float32)))
    assert (t * 2.0 + 1).dtype == np.float32


# -- float32 at the model's shapes, against float64 compositions of the elementary ops ---------------
# The fused ops (one formula per backward, BLAS sums, in-place passes) must keep float32 float32 and
# agree with the same function built from small ops (each checked by finite differences above)
# computed in float64; shapes include the benchmark GPT's (batch 8, sequence 128, d_model 256).

def _grads64(fn, arrays, g):
    """Value and input gradients of ``fn`` (Tensors -> Tensor) in float64, for upstream gradient g."""
    from minidist.autograd.tensor import Tensor

    ts = [Tensor(np.asarray(a, np.float64), requires_grad=True) for a in arrays]
    out = fn(*ts)
    out.backward(Tensor(np.asarray(g, np.float64)))
    return out.numpy(), [t.grad for t in ts]


def _grads32(fn, arrays, g):
    from minidist.autograd.tensor import Tensor

    ts = [Tensor(np.asarray(a, np.float32), requires_grad=True) for a in arrays]
    out = fn(*ts)
    out.backward(Tensor(np.asarray(g, np.float32)))
    assert out.dtype == np.float32 and all(t.grad.dtype == np.float32 for t in ts)
    return out.numpy(), [t.grad for t in ts]


def _close(got, want, what, rel=3e-5):
    """float32 against float64: within ``rel`` of the reference's largest magnitude."""
    scale = max(float(np.abs(want).max()), 1e-30)
    err = float(np.abs(np.asarray(got, np.float64) - want).max())
    assert err <= rel * scale, f"{what}: max error {err:.3g} > {rel:g} x max |reference| {scale:.3g}"


def _layer_norm_composed(x, w, b, eps=1e-5):
    xc = x - x.mean(axis=-1, keepdims=True)
    var = (xc * xc).mean(axis=-1, keepdims=True)
    return xc * (var + eps) ** -0.5 * w + b


@pytest.mark.parametrize("shape,offset", [((8, 128, 256), 0.0), ((3, 5, 7), 0.0), ((6, 33), 30.0),
                                          ((4, 1), 0.0)])
def test_layer_norm_float32_matches_the_float64_composition(shape, offset):
    """offset 30: the mean dwarfs the spread (1), which the centring pass must keep accurate."""
    rng = np.random.default_rng(len(shape))
    n = shape[-1]
    x = rng.standard_normal(shape) + offset
    w, b = 1.0 + 0.5 * rng.standard_normal(n), rng.standard_normal(n)
    g = rng.standard_normal(shape)
    out, grads = _grads32(ops.layer_norm, [x, w, b], g)
    want, want_grads = _grads64(_layer_norm_composed, [x, w, b], g)
    _close(out, want, "y")
    for name, got, ref in zip(("dx", "dw", "db"), grads, want_grads):
        _close(got, ref, name, rel=1e-4 if offset else 3e-5)


@pytest.mark.parametrize("shape,v", [((8, 128), 256), ((2, 3), 5)])
def test_cross_entropy_float32_matches_the_float64_composition(shape, v):
    rng = np.random.default_rng(v)
    logits = 3.0 * rng.standard_normal(shape + (v,))
    targets = rng.integers(0, v, shape)
    targets[0, :2] = -1  # ignored: counted neither in the sum nor in n
    keep = targets.reshape(-1) != -1
    rows, cols = np.flatnonzero(keep), targets.reshape(-1)[keep]

    def composed(x):
        logp = ops.log_softmax(x.reshape(-1, v), axis=-1)
        return -logp[rows, cols].sum() / len(rows)

    out, (grad,) = _grads32(lambda x: ops.cross_entropy(x, targets), [logits], 1.0)
    want, (want_grad,) = _grads64(composed, [logits], 1.0)
    _close(out, want, "loss", rel=1e-6)
    _close(grad, want_grad, "d logits")
    assert np.all(grad.reshape(-1, v)[~keep] == 0)


@pytest.mark.parametrize("backend", BACKENDS)
@given(b=st.integers(1, 2), t=st.integers(1, 4), h=st.integers(1, 3), d=st.integers(1, 3),
       causal=st.booleans(), seed=st.integers(0, 2**16))
def test_packed_attention(backend, b, t, h, d, causal, seed):
    qkv = np.random.default_rng(seed).standard_normal((b, t, 3 * h * d))
    gradcheck(lambda x: ops.packed_attention(x, h, causal=causal), [qkv], backend=backend, atol=1e-5)


def _attention_composed(qkv, n_head, causal=True):
    """Heads split by reshape/transpose/indexing, masked scores, ``ops.softmax``, heads merged."""
    b, t, three_c = qkv.shape
    d = three_c // (3 * n_head)
    parts = qkv.reshape(b, t, 3, n_head, d).transpose(2, 0, 3, 1, 4)
    q, k, v = parts[0], parts[1], parts[2]
    s = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / np.sqrt(d))
    if causal:
        s = s + np.triu(np.full((t, t), -1e30), 1)  # -1e30 above the diagonal: exp gives exactly 0
    y = ops.softmax(s, axis=-1) @ v
    return y.transpose(0, 2, 1, 3).reshape(b, t, n_head * d)


@pytest.mark.parametrize("shape,n_head", [((8, 128, 3 * 256), 4), ((2, 5, 3 * 6), 3)])
def test_packed_attention_float32_matches_the_float64_composition(shape, n_head):
    rng = np.random.default_rng(n_head)
    qkv = rng.standard_normal(shape)
    g = rng.standard_normal(shape[:2] + (shape[2] // 3,))
    out, (grad,) = _grads32(lambda x: ops.packed_attention(x, n_head), [qkv], g)
    want, (want_grad,) = _grads64(lambda x: _attention_composed(x, n_head), [qkv], g)
    _close(out, want, "y")
    third = shape[2] // 3
    for i, name in enumerate(("dq", "dk", "dv")):
        part = slice(i * third, (i + 1) * third)
        _close(grad[..., part], want_grad[..., part], name, rel=1e-4)


def test_linear_float32_matches_the_float64_composition():
    """The GPT's MLP shape; the reference is ``matmul`` + ``add`` (other ops, other backward code)."""
    rng = np.random.default_rng(5)
    x, w, b = rng.standard_normal((8, 128, 256)), rng.standard_normal((256, 1024)), rng.standard_normal(1024)
    g = rng.standard_normal((8, 128, 1024))
    out, grads = _grads32(ops.linear, [x, w, b], g)
    want, want_grads = _grads64(lambda x, w, b: ops.matmul(x, w) + b, [x, w, b], g)
    _close(out, want, "y")
    for name, got, ref in zip(("dx", "dw", "db"), grads, want_grads):
        _close(got, ref, name)


def test_packed_attention_names_a_bad_shape():
    from minidist.autograd.tensor import Tensor

    with pytest.raises(ValueError, match=r"qkv of shape \(2, 3, 10\) with n_head=2.*multiple of 3·n_head"):
        ops.packed_attention(Tensor(np.zeros((2, 3, 10))), 2)
