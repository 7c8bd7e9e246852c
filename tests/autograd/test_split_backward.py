"""Backward split into B (input gradients) and W (weight gradients) == one backward, bit for bit."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minidist.autograd import ops
from minidist.autograd.tensor import Tensor
from minidist.nn import GPT, GPTConfig
from minidist.parallel.pipeline.split_backward import backward_input

CFG = GPTConfig(vocab_size=16, block_size=4, n_layer=2, n_head=2, d_model=8, dtype="float64")


def _run(layers, x, y, split: bool, microbatches: int):
    """Forward+backward `microbatches` times through `layers` (slices of a GPT); return the input
    gradients and the accumulated parameter gradients."""
    xgrads = []
    for k in range(microbatches):
        inp = Tensor(x[k], requires_grad=True) if x[k].dtype.kind == "f" else x[k]
        out = inp
        for layer in layers:
            out = layer(out)
        loss = ops.cross_entropy(out, y[k]) * 0.5
        if split:
            queue = backward_input(loss, inputs=[inp] if isinstance(inp, Tensor) else [])
            assert all(p.grad is None for layer in layers for p in layer.parameters()) or k > 0
            queue.run()
        else:
            loss.backward()
        xgrads.append(inp.grad if isinstance(inp, Tensor) else None)
    return xgrads, [p.grad for layer in layers for p in layer.parameters()]


@given(first=st.booleans(), microbatches=st.integers(1, 3), seed=st.integers(0, 50))
@settings(max_examples=12, deadline=None)
def test_b_then_w_equals_backward_bit_for_bit(first, microbatches, seed):
    """A middle stage (blocks + head, activations in) and the first stage (embedding: ids in, no input
    gradient, everything in W); gradients accumulated over several microbatches as a pipeline does."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 16, (microbatches, 2, 4))
    if first:
        x = rng.integers(0, 16, (microbatches, 2, 4))
    else:
        x = rng.standard_normal((microbatches, 2, 4, 8))
    got, want = [], []
    for split, out in ((True, got), (False, want)):
        model = GPT(CFG)
        layers = list(model) if first else list(model)[1:]
        out.append(_run(layers, x, y, split, microbatches))
    (gx, gp), (wx, wp) = got[0], want[0]
    for a, b in zip(gx, wx):
        assert (a is None and b is None) or np.array_equal(a, b)
    assert len(gp) == len(wp) and all(g is not None for g in gp)
    for a, b in zip(gp, wp):
        assert a.dtype == b.dtype and np.array_equal(a, b)


def test_b_leaves_parameters_untouched_and_w_fills_them():
    rng = np.random.default_rng(0)
    w = Tensor(rng.standard_normal((3, 5)), requires_grad=True)
    b = Tensor(rng.standard_normal(5), requires_grad=True)
    x = Tensor(rng.standard_normal((4, 3)), requires_grad=True)
    c = rng.standard_normal((4, 5))
    loss = (ops.linear(x, w, b) * c).sum()
    queue = backward_input(loss, inputs=[x])
    np.testing.assert_allclose(x.grad, c @ w.data.T, rtol=1e-12)  # dL/dx = C Wᵀ, by hand
    assert w.grad is None and b.grad is None and len(queue) == 1
    queue.run()
    np.testing.assert_allclose(w.grad, x.data.T @ c, rtol=1e-12)
    np.testing.assert_allclose(b.grad, c.sum(axis=0), rtol=1e-12)
    with pytest.raises(RuntimeError, match="twice"):
        queue.run()


def test_memory_held_between_b_and_w_is_accounted():
    """A Linear's W needs its input X (rows x in) and output gradient G (rows x out): that, in float64,
    is what the queue holds; the weight it also saved is a parameter and not counted. After W: 0."""
    rows, d_in, d_out = 6, 3, 5
    rng = np.random.default_rng(1)
    w = Tensor(rng.standard_normal((d_in, d_out)), requires_grad=True)
    x = Tensor(rng.standard_normal((rows, d_in)), requires_grad=True)
    h = ops.linear(x, w)
    loss = (h * h).sum()
    queue = backward_input(loss, inputs=[x])
    assert queue.nbytes() == 8 * (rows * d_in + rows * d_out)
    queue.run()
    assert queue.nbytes() == 0


def test_bad_seed_is_refused():
    x = Tensor(np.ones((2, 2)), requires_grad=True)
    with pytest.raises(RuntimeError, match="explicit gradient"):
        backward_input(x * 2.0, inputs=[x])
    with pytest.raises(ValueError, match="does not match"):
        backward_input(x * 2.0, np.ones(3), inputs=[x])
    with pytest.raises(RuntimeError, match="computed from inputs"):
        backward_input(x, inputs=[x])
