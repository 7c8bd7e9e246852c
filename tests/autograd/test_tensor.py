"""The Tensor (minidist/autograd/tensor.py): seeds, errors, dtypes, backends, the kernel selector."""


import numpy as np
import pytest

import minidist as md
from minidist.accel.backend import get_backend
from minidist.autograd import ops
from minidist.autograd.tensor import Tensor


def t(a, grad=True):
    return Tensor(np.asarray(a, dtype=np.float64), requires_grad=grad)


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


def test_a_registered_engine_runs_ops_on_other_arrays_and_never_on_numpy():
    """The compilation seam (``minidist.accel.compiled``) is the one hook an array engine has (the JAX
    engine's): its ``kernel`` picks the class for inputs that are not NumPy arrays (here an ndarray
    subclass stands in for one)."""
    from minidist.accel import compiled

    class Other(np.ndarray):
        pass

    class Doubled(ops.Mul):  # what the engine hands back: a subclass that runs instead
        @staticmethod
        def forward(ctx, a, b):
            return 2 * ops.Mul.forward(ctx, a, b)

    asked = []

    class Engine:
        kernel = staticmethod(lambda c: asked.append(c) or (Doubled if c is ops.Mul else c))

    before = compiled.ENGINE
    compiled.register(Engine)
    try:
        other = Tensor(np.full(3, 3.0).view(Other), requires_grad=True)
        np.testing.assert_array_equal(np.asarray((other * 2.0).data), [12.0, 12.0, 12.0])
        np.testing.assert_array_equal((t([3.0]) * 2.0).data, [6.0])  # NumPy: the engine is not asked
        assert asked == [ops.Mul]
    finally:
        compiled.register(before)
