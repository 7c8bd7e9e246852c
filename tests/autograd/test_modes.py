"""The switches ops read (minidist/autograd/modes.py): no_grad records nothing, saved-tensor hooks see
every saved array."""

import numpy as np

import minidist as md
from minidist.autograd import ops
from minidist.autograd.modes import saved_tensors_hooks
from minidist.autograd.tensor import Tensor


def t(a, grad=True):
    return Tensor(np.asarray(a, dtype=np.float64), requires_grad=grad)


def test_no_grad_records_nothing():
    x = t(1.0)
    with md.no_grad():
        y = x * 2.0
    assert not y.requires_grad and y.is_leaf


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
