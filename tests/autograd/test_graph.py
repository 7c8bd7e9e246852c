"""The backward walk (minidist/autograd/graph.py): every gradient complete before it flows, accumulation,
hooks, deep graphs without recursion, a freed graph refused."""

import sys

import numpy as np
import pytest

from minidist.autograd.tensor import Tensor


def t(a, grad=True):
    return Tensor(np.asarray(a, dtype=np.float64), requires_grad=grad)


def test_deep_graph_has_no_recursion_limit():
    x = t(1.0)
    y = x
    for _ in range(sys.getrecursionlimit() * 3):
        y = y * 1.0 + 0.0
    y.backward()
    assert x.grad == 1.0


def test_empty_and_zero_d_tensors_flow_through_backward():
    """A 0-size batch gives 0-size gradients of the right shape; a 0-d tensor is its own scalar loss;
    a dot product of vectors (0-d output) sends each vector the other; 2 ** x has gradient 2^x ln 2."""
    empty = t(np.zeros((0, 3)))
    w = t(np.ones((3, 2)))
    ((empty @ w) * 2.0).sum().backward()
    assert empty.grad.shape == (0, 3) and w.grad.shape == (3, 2)
    np.testing.assert_array_equal(w.grad, np.zeros((3, 2)))  # no rows: nothing flows into w
    s = t(1.5)
    (s * s * s).backward()
    assert s.grad.shape == () and s.grad == 3 * 1.5 ** 2
    a, b = t([1.0, 2.0, 3.0]), t([4.0, 5.0, 6.0])
    (a @ b).backward()
    np.testing.assert_array_equal(a.grad, [4.0, 5.0, 6.0])
    np.testing.assert_array_equal(b.grad, [1.0, 2.0, 3.0])
    x = t([0.0, 1.0, 3.0])
    (2.0 ** x).sum().backward()
    np.testing.assert_allclose(x.grad, [np.log(2), 2 * np.log(2), 8 * np.log(2)], rtol=1e-15)


def test_tensor_used_many_times_accumulates():
    x = t([1.0, 2.0])
    y = (x * x + x * 3.0 + x).sum()  # dy/dx = 2x + 4
    y.backward()
    np.testing.assert_allclose(x.grad, [6.0, 8.0])


def test_gradient_accumulates_across_backward_calls():
    x = t(2.0)
    (x * x).backward()
    (x * 3.0).backward()
    assert x.grad == 4.0 + 3.0


def test_diamond_graph_waits_for_both_branches():
    x = t(3.0)
    a = x * 2.0
    b = a * a + a.exp()  # a used by two consumers
    b.backward()
    np.testing.assert_allclose(x.grad, 2 * (2 * 6.0 + np.exp(6.0)))


def test_branch_without_gradient_does_not_block_others():
    x = t([1.0, -1.0])
    idx_branch = x[np.array([0])] * 0.0  # contributes zeros
    frozen = Tensor(np.ones(2))  # needs no gradient
    y = (x * frozen).sum() + idx_branch.sum()
    y.backward()
    np.testing.assert_allclose(x.grad, [1.0, 1.0])


def test_post_accumulate_hooks_fire_in_reverse_layer_order():
    w1, w2, w3 = t(1.0), t(2.0), t(3.0)
    order = []
    for name, w in (("w1", w1), ("w2", w2), ("w3", w3)):
        w.register_post_accumulate_grad_hook(lambda p, name=name: order.append((name, float(p.grad))))
    y = ((t(1.0, grad=False) * w1) * w2) * w3
    y.backward()
    assert [n for n, _ in order] == ["w3", "w2", "w1"]
    assert dict(order) == {"w1": 6.0, "w2": 3.0, "w3": 2.0}


def test_tensor_hook_can_replace_gradient():
    x = t(1.0)
    y = x * 3.0
    y.register_hook(lambda g: g * 10)
    y.backward()
    assert x.grad == 30.0


def test_second_backward_without_retain_graph_is_an_error():
    x = t(1.0)
    y = x.exp()
    z = y * 2.0
    z.backward()
    with pytest.raises(RuntimeError, match="retain_graph"):
        z.backward()
    x2 = t(1.0)
    z2 = x2.exp() * 2.0
    z2.backward(retain_graph=True)
    z2.backward()
    np.testing.assert_allclose(x2.grad, 4 * np.e)


def test_a_node_that_receives_no_gradient_still_releases_its_parents():
    """An op may return None for an input that wants a gradient (nothing flows back through it); the
    node that made that input must still tell its own parents, or a leaf reached along another path
    would wait for it forever. loss = stop(x·w) + Σ 3w: d/dw = 3 (the other path only), d/dx: none."""
    from minidist.autograd.tensor import Function

    class StopGradient(Function):
        @staticmethod
        def forward(ctx, a):
            return a.sum()

        @staticmethod
        def backward(ctx, g):
            return None

    x, w = t([1.0, 2.0]), t([5.0, 7.0])
    loss = StopGradient.apply(x * w) + (w * 3.0).sum()
    loss.backward()
    assert x.grad is None
    np.testing.assert_array_equal(w.grad, [3.0, 3.0])
