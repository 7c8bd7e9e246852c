"""Grader for exercises/autograd.py: each backward against central finite differences of the
forward, written here in plain NumPy, on random shapes (and a few hand-worked cases).

The expected gradients never come from minidist's own ops, so a bug in the library cannot flow into
the grader. ``CHECKS[task](impl)`` raises AssertionError when ``impl.<task>`` is wrong. They run here
against minidist's own ops (must pass) and deliberately broken formulas (must fail).
"""

import types

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from minidist.autograd import ops
from minidist.autograd.tensor import Tensor
from minidist.grading import assert_close, untouched

GRADE = settings(max_examples=10, deadline=None, derandomize=True, database=None, report_multiple_bugs=False)


# -- the forwards, in plain NumPy (the specs of exercises/autograd.py) -------------------------------

def linear_forward(x, w, b):
    return x @ w + b


def layer_norm_forward(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * w + b


def cross_entropy_forward(logits, targets):
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return -logp[np.arange(len(targets)), targets].mean()


def attention_forward(q, k, v):
    t, d = q.shape[-2], q.shape[-1]
    s = q @ k.swapaxes(-1, -2) / np.sqrt(d) + np.triu(np.full((t, t), -np.inf), 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True) @ v


def numerical_grads(f, arrays, g, eps=1e-6):
    """d/d(arrays) of sum(f(*arrays) * g) by central differences (float64: error ~1e-9)."""
    arrays = [np.array(a, dtype=np.float64) for a in arrays]
    out = []
    for a in arrays:
        grad = np.zeros_like(a)
        for i in np.ndindex(a.shape):
            keep = a[i]
            a[i] = keep + eps
            up = np.sum(f(*arrays) * g)
            a[i] = keep - eps
            down = np.sum(f(*arrays) * g)
            a[i] = keep
            grad[i] = (up - down) / (2 * eps)
        out.append(grad)
    return out


def _close(got, want, what):
    got = got if isinstance(got, tuple) else (got,)
    assert len(got) == len(want), f"{what}: returned {len(got)} arrays, expected {len(want)}"
    for i, (a, b) in enumerate(zip(got, want)):
        assert np.shape(a) == np.shape(b), f"{what}: gradient {i} has shape {np.shape(a)}, expected {b.shape}"
        assert_close(a, b, f"{what}: gradient {i} of {len(want)} (vs finite differences)",
                     rtol=1e-5, atol=1e-6)


lead = st.lists(st.integers(1, 3), min_size=1, max_size=2).map(tuple)


def check_linear_backward(impl):
    @GRADE
    @given(lead=lead, n=st.integers(1, 5), m=st.integers(1, 5), seed=st.integers(0, 99))
    def prop(lead, n, m, seed):
        rng = np.random.default_rng(seed)
        x, w, b = rng.standard_normal(lead + (n,)), rng.standard_normal((n, m)), rng.standard_normal(m)
        g = rng.standard_normal(lead + (m,))
        got = untouched(impl.linear_backward)(x.copy(), w.copy(), g.copy())  # first: a stub fails at once
        _close(got, numerical_grads(linear_forward, [x, w, b], g), "linear_backward")
    prop()


def check_layer_norm_backward(impl):
    @GRADE
    @given(lead=lead, n=st.integers(2, 6), seed=st.integers(0, 99))
    def prop(lead, n, seed):
        rng = np.random.default_rng(seed)
        x, w, b = rng.standard_normal(lead + (n,)), rng.standard_normal(n), rng.standard_normal(n)
        g = rng.standard_normal(lead + (n,))
        got = untouched(impl.layer_norm_backward)(x.copy(), w.copy(), g.copy())
        _close(got, numerical_grads(layer_norm_forward, [x, w, b], g), "layer_norm_backward")
    prop()


def check_cross_entropy_backward(impl):
    @GRADE
    @given(n=st.integers(1, 6), v=st.integers(2, 7), seed=st.integers(0, 99))
    def prop(n, v, seed):
        rng = np.random.default_rng(seed)
        logits, targets = rng.standard_normal((n, v)) * 3, rng.integers(0, v, n)
        got = untouched(impl.cross_entropy_backward)(logits.copy(), targets.copy())
        _close(got, numerical_grads(lambda x: cross_entropy_forward(x, targets), [logits], 1.0),
               "cross_entropy_backward")
    prop()
    # worked by hand: equal logits give softmax 1/V; minus one-hot; over N rows
    want = np.array([[-0.375, 0.125, 0.125, 0.125], [0.125, 0.125, 0.125, -0.375]])
    got = untouched(impl.cross_entropy_backward)(np.zeros((2, 4)), np.array([0, 3]))
    _close(got, [want], "cross_entropy_backward")


def check_attention_backward(impl):
    @GRADE
    @given(b=st.integers(1, 2), h=st.integers(1, 2), t=st.integers(1, 5), d=st.integers(1, 4),
           seed=st.integers(0, 99))
    def prop(b, h, t, d, seed):
        rng = np.random.default_rng(seed)
        q, k, v, g = (rng.standard_normal((b, h, t, d)) for _ in range(4))
        got = untouched(impl.attention_backward)(q.copy(), k.copy(), v.copy(), g.copy())
        _close(got, numerical_grads(attention_forward, [q, k, v], g), "attention_backward")
    prop()
    # worked by hand: one query, one key -- the weight is 1, so y = v: gq = gk = 0, gv = g
    q, k, v, g = (np.full((1, 1, 1, 2), c) for c in (1.0, 2.0, 3.0, 0.5))
    got = untouched(impl.attention_backward)(q, k, v, g)
    _close(got, [np.zeros((1, 1, 1, 2))] * 2 + [g], "attention_backward")


CHECKS = {"linear_backward": check_linear_backward, "layer_norm_backward": check_layer_norm_backward,
          "cross_entropy_backward": check_cross_entropy_backward,
          "attention_backward": check_attention_backward}


def _grads(fn, *arrays, g):
    """Gradients by minidist's autograd: the reference implementation graded here, not an answer."""
    ts = [Tensor(a.copy(), requires_grad=True) for a in arrays]
    fn(*ts).backward(g)
    return [t.grad for t in ts]


def reference():
    """minidist's own ops, called through their Function classes' backward."""
    def via(fn, n_inputs):
        def backward(*args):
            *arrays, g = args
            return tuple(_grads(fn, *arrays, g=g)[:n_inputs])
        return backward

    def linear_backward(x, w, g):
        return tuple(_grads(ops.linear, x, w, np.zeros(w.shape[1]), g=g))

    def layer_norm_backward(x, w, g, eps=1e-5):
        return tuple(_grads(lambda a, b, c: ops.layer_norm(a, b, c, eps), x, w, np.zeros_like(w), g=g))

    def cross_entropy_backward(logits, targets):
        return _grads(lambda x: ops.cross_entropy(x, targets), logits, g=np.array(1.0))[0]

    return types.SimpleNamespace(linear_backward=linear_backward, layer_norm_backward=layer_norm_backward,
                                 cross_entropy_backward=cross_entropy_backward,
                                 attention_backward=via(ops.scaled_dot_product_attention, 3))


def _ln_without_mean_term(x, w, g, eps=1e-5):  # forgets that the mean depends on x
    mu = x.mean(-1, keepdims=True)
    rstd = 1 / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps)
    xhat = (x - mu) * rstd
    dxhat = g * w
    axes = tuple(range(x.ndim - 1))
    return rstd * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdims=True)), (g * xhat).sum(axes), g.sum(axes)


def _linear_no_batch_sum(x, w, g):  # keeps gb per row
    return g @ w.T, x.reshape(-1, x.shape[-1]).T @ g.reshape(-1, g.shape[-1]), g


def _ce_sum_not_mean(logits, targets):
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    p[np.arange(len(targets)), targets] -= 1
    return p


def _attention_no_mask(q, k, v, g):  # differentiates attention without the causal mask
    d = q.shape[-1]
    s = q @ k.swapaxes(-1, -2) / np.sqrt(d)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    gp = g @ v.swapaxes(-1, -2)
    gs = p * (gp - (gp * p).sum(-1, keepdims=True)) / np.sqrt(d)
    return gs @ k, gs.swapaxes(-1, -2) @ q, p.swapaxes(-1, -2) @ g


def _ln_centres_x_in_place(x, w, g, eps=1e-5):  # right gradients (layer norm ignores a shift), but
    x -= x.mean(-1, keepdims=True)                 # centres the caller's x
    return reference().layer_norm_backward(x, w, g, eps)


BROKEN = {"linear_backward": [_linear_no_batch_sum],
          "layer_norm_backward": [_ln_without_mean_term, _ln_centres_x_in_place],
          "cross_entropy_backward": [_ce_sum_not_mean], "attention_backward": [_attention_no_mask]}
