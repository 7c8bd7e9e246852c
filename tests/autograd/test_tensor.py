"""The autograd engine's contract: graph walking, accumulation, hooks, no_grad, saved-tensor hooks."""

import sys

import numpy as np
import pytest

import minidist as md
from minidist.accel.backend import get_backend
from minidist.autograd import ops
from minidist.autograd.tensor import Tensor, saved_tensors_hooks


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


def test_no_grad_records_nothing():
    x = t(1.0)
    with md.no_grad():
        y = x * 2.0
    assert not y.requires_grad and y.is_leaf


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


def test_saved_tensor_hooks_see_every_saved_array():
    packed = []

    def pack(a):
        packed.append(a.shape)
        return ("box", a.copy())

    with saved_tensors_hooks(pack, lambda box: box[1]):
        x = t(np.ones((2, 3)))
        y = ops.tanh(x @ t(np.ones((3, 4)))).sum()
    y.backward()
    assert (2, 3) in packed and (3, 4) in packed and (2, 4) in packed
    np.testing.assert_allclose(x.grad, np.full((2, 3), 4 * (1 - np.tanh(3.0) ** 2)))


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


def test_backward_on_non_scalar_needs_gradient():
    x = t([1.0, 2.0])
    with pytest.raises(RuntimeError, match="non-scalar.*explicit gradient"):
        (x * 2.0).backward()
    (x * 2.0).backward(np.ones(2))
    np.testing.assert_allclose(x.grad, [2.0, 2.0])


def test_matmul_shape_error_names_both_shapes():
    with pytest.raises(ValueError, match=r"\(2, 3\) and \(4, 5\)"):
        t(np.ones((2, 3))) @ t(np.ones((4, 5)))


def test_unknown_backend_lists_known_ones():
    with pytest.raises(ValueError, match="numpy, cupy, jax"):
        get_backend("tensorflow")


def test_dtype_is_required_and_kept():
    x = md.tensor([1, 2], dtype=np.float32)
    assert x.dtype == np.float32
    assert (x * 2.5).dtype == np.float32


def test_jax_backend_keeps_float64():
    pytest.importorskip("jax")
    x = md.tensor([1.0, 2.0], dtype=np.float64, backend="jax", requires_grad=True)
    y = (x * x).sum()
    assert y.dtype == np.float64
    y.backward()
    np.testing.assert_allclose(np.asarray(x.grad), [2.0, 4.0])


def test_a_registered_kernel_selector_runs_ops_on_other_arrays_and_never_on_numpy():
    """``register_kernel_selector`` is the one hook an array library has (the JAX engine's): it picks
    the class for inputs that are not NumPy arrays (here an ndarray subclass stands in for one)."""
    tensor_module = sys.modules["minidist.autograd.tensor"]

    class Other(np.ndarray):
        pass

    class Doubled(ops.Mul):  # what the selector hands back: a subclass that runs instead
        @staticmethod
        def forward(ctx, a, b):
            return 2 * ops.Mul.forward(ctx, a, b)

    asked = []
    before = tensor_module._KERNEL
    tensor_module.register_kernel_selector(lambda c: asked.append(c) or (Doubled if c is ops.Mul else c))
    try:
        other = Tensor(np.full(3, 3.0).view(Other), requires_grad=True)
        np.testing.assert_array_equal(np.asarray((other * 2.0).data), [12.0, 12.0, 12.0])
        np.testing.assert_array_equal((t([3.0]) * 2.0).data, [6.0])  # NumPy: the selector is not asked
        assert asked == [ops.Mul]
        with pytest.raises(TypeError, match="register_kernel_selector: fn must be callable"):
            tensor_module.register_kernel_selector("kernel")
    finally:
        tensor_module.register_kernel_selector(before)
