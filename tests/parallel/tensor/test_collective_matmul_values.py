"""Collective matmul's helpers and boundaries on their own: the hidden share of a timeline and its
lanes (what the lessons print) against hand-worked events, tensor-parallel size 1 (no ring at all: the
weight gradient must still be computed), and each refusal of a bad operand."""

import numpy as np
import pytest

from minidist.autograd.tensor import Tensor
from minidist.comm import run
from minidist.parallel.tensor.collective_matmul import (
    all_gather_matmul,
    hidden_share,
    lanes,
    matmul_reduce_scatter,
)
from tests.parallel.tensor.test_collective_matmul import mlp_rank


def ev(cat, t0, t1):
    return {"cat": cat, "t0": t0, "t1": t1, "name": cat}


# (events, the share of the sends' time that ran during a compute), by hand
SHARES = [
    ([ev("compute", 0, 1), ev("send", 0, 2), ev("send", 2, 4)], 1 / 4),      # 1 s of 4 s hidden
    ([ev("compute", 0, 4), ev("send", 1, 2)], 1.0),                          # all of it
    ([ev("compute", 0, 1), ev("send", 5, 6)], 0.0),                          # apart: clamped at 0
    ([ev("compute", 3, 9), ev("send", 0, 2), ev("send", 2, 5)], 2 / 5),      # the second half-covered
    ([ev("send", 0, 4), ev("compute", 0, 1), ev("compute", 2, 3)], 2 / 4),   # two computes in one send
    ([ev("compute", 0, 1), ev("wait", 1, 3), ev("send", 0, 1)], 1.0),        # a wait is not a hop
    ([ev("compute", 0, 1)], 0.0),                                            # no send: nothing to hide
    ([ev("compute", 0, 1), ev("send", 0.5, 0.5)], 0.0),                      # a zero-length send
    ([], 0.0),
]


@pytest.mark.parametrize("events, want", SHARES)
def test_hidden_share_by_hand(events, want):
    assert hidden_share(events) == pytest.approx(want, abs=1e-15)


def test_lanes_by_hand():
    """width 8 over [0, 4]: a compute on [0, 2] fills columns 0-3, a send on [1, 4] columns 2-7."""
    got = lanes([ev("compute", 0, 2), ev("send", 1, 4)], width=8)
    assert got == "  compute |MMMM    |\n  link    |  ~~~~~~|"
    # the span is the first start to the LAST END (a send that ends last is drawn to the edge)
    got = lanes([ev("compute", 10, 11), ev("send", 10, 14), ev("wait", 10, 20)], width=10)
    assert got == "  compute |M         |\n  link    |~~~~      |"
    # a zero-length event still shows one column; one at the very end stays inside the row
    got = lanes([ev("compute", 0, 4), ev("send", 2, 2), ev("send", 4, 4)], width=4)
    assert got == "  compute |MMMM|\n  link    |  ~~|"


@pytest.mark.parametrize("bias", [True, False])
def test_tensor_parallel_size_1_computes_every_gradient_as_the_plain_layers(bias):
    """tp = 1: no hop at all -- the first (and only) step of each ring is also its last. The weight
    gradients (computed 'beside' the first hop, of which there is none) must exist and equal the plain
    layers', as x's, the bias's and the output do."""
    rng = np.random.default_rng(0)
    x, g = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3, 4))

    def body(comm):
        fused = mlp_rank(comm, x, g, hidden=6, overlap=True, bias=bias)
        plain = mlp_rank(comm, x, g, hidden=6, overlap=False, bias=bias)
        return fused, plain

    [((y1, g1, led1), (y0, g0, led0))] = run(body, ranks=1)
    np.testing.assert_allclose(y1, y0, rtol=0, atol=1e-13)
    assert len(g1) == len(g0) == (4 if bias else 3)
    for a, c in zip(g1, g0):
        assert a is not None and c is not None
        np.testing.assert_allclose(a, c, rtol=0, atol=1e-13)
    assert led1 == led0 == (0, 0)  # one rank sends nothing


def test_the_two_ops_on_one_rank_are_plain_products():
    x = np.arange(12.0).reshape(1, 3, 4)
    w = np.arange(8.0).reshape(4, 2)

    def body(comm):
        xt, wt = Tensor(x, requires_grad=True), Tensor(w, requires_grad=True)
        y = all_gather_matmul(xt, wt, None, comm)
        y.sum().backward()
        xr, wr = Tensor(x, requires_grad=True), Tensor(w, requires_grad=True)
        z = matmul_reduce_scatter(xr, wr, comm)
        (z * 2.0).sum().backward()
        return y.numpy(), xt.grad, wt.grad, z.numpy(), xr.grad, wr.grad

    [(y, dx, dw, z, dxr, dwr)] = run(body, ranks=1)
    np.testing.assert_array_equal(y, x @ w)
    np.testing.assert_array_equal(dx, np.ones((1, 3, 2)) @ w.T)
    np.testing.assert_array_equal(dw, x[0].T @ np.ones((3, 2)))
    np.testing.assert_array_equal(z, x @ w)
    np.testing.assert_array_equal(dxr, 2 * np.ones((1, 3, 2)) @ w.T)
    np.testing.assert_array_equal(dwr, x[0].T @ (2 * np.ones((3, 2))))


SHAPE = r"needs x of shape \(batch, sequence, 3\), got "


@pytest.mark.parametrize("xs, ws, fn, says", [
    ((2, 3), (3, 4), all_gather_matmul, "all_gather_matmul " + SHAPE + r"\(2, 3\)"),
    ((1, 2, 5), (3, 4), all_gather_matmul, SHAPE + r"\(1, 2, 5\)"),  # 3-D, the wrong features
    ((1, 2, 2, 3), (3, 4), all_gather_matmul, SHAPE + r"\(1, 2, 2, 3\)"),
    ((1, 4, 5), (3, 4), matmul_reduce_scatter, "matmul_reduce_scatter " + SHAPE + r"\(1, 4, 5\)"),
    ((1, 3, 3), (3, 4), matmul_reduce_scatter, r"sequence length \(collective matmul\)"),  # 3 over 2 ranks
])
def test_bad_operands_are_refused_naming_the_rank_and_the_shape(xs, ws, fn, says):
    def body(comm):
        args = (Tensor(np.ones(xs)), Tensor(np.ones(ws)))
        return fn(*args, None, comm) if fn is all_gather_matmul else fn(*args, comm)

    with pytest.raises(ValueError, match=says) as info:
        run(body, ranks=2)
    assert "rank 0" in str(info.value) or "rank 1" in str(info.value)
