"""Matrix products: ``Matmul`` (batched, broadcasting) and ``Linear`` (x·W + b, the workhorse of every layer).

``low_precision`` says which weight dtypes ``linear`` multiplies the way a tensor core does
(2-byte floats, accumulated in float32).
"""

from __future__ import annotations

import numpy as np

from minidist.autograd.ops.arrays import _back_to, _rows, _xp, unbroadcast
from minidist.autograd.tensor import Function


def _check_matmul(a, b):
    if a.ndim == 0 or b.ndim == 0 or a.shape[-1] != b.shape[-2 if b.ndim > 1 else 0]:
        raise ValueError(f"matmul: shapes {tuple(a.shape)} and {tuple(b.shape)} don't match: the last "
                         f"axis of the first ({a.shape[-1] if a.ndim else '-'}) must equal the "
                         f"{'second-to-last' if b.ndim > 1 else 'only'} axis of the second")


class Matmul(Function):
    """Batched matrix product with NumPy broadcasting of the batch axes."""

    @staticmethod
    def forward(ctx, a, b):
        _check_matmul(a, b)
        ctx.save(a if ctx.needs_grad[1] else None, b if ctx.needs_grad[0] else None)
        ctx.shapes = (a.shape, b.shape)  # (the side that wants no gradient is not saved)
        return a @ b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved
        (a_shape, b_shape), xp = ctx.shapes, _xp(g)
        ga = gb = None
        if ctx.needs_grad[0]:
            if len(b_shape) == 1:
                ga = g[..., None] * b
            elif len(a_shape) == 1:
                ga = _rows(g[..., None, :] @ xp.swapaxes(b, -1, -2)).sum(axis=0)
            else:
                ga = unbroadcast(g @ xp.swapaxes(b, -1, -2), a_shape)
        if ctx.needs_grad[1]:
            if len(b_shape) == 2 and a.ndim >= 2:  # a weight: fold the batch axes into one big product
                gb = _rows(a).T @ _rows(g)
            elif a.ndim == 1 and len(b_shape) == 1:  # a dot product: g is 0-d
                gb = g * a
            elif a.ndim == 1:
                gb = unbroadcast(a[:, None] * g[..., None, :], b_shape)
            elif len(b_shape) == 1:
                gb = _rows(a * g[..., None]).sum(axis=0)
            else:
                gb = unbroadcast(xp.swapaxes(a, -1, -2) @ g, b_shape)
        return ga, gb


class Linear(Function):
    """y = x·W + b with W of shape (in, out): the workhorse of every layer.

    Every leading axis of x is a batch of rows: with X the (rows, in) matrix, G the (rows, out)
    gradient and 1 a column of ones, Y = X·W + 1·bᵀ, so gX = G·Wᵀ, gW = Xᵀ·G and gb = Gᵀ·1.

    ``compute`` (mixed precision: float32 for bf16/fp16 weights): a tensor core's product -- the
    inputs cast up inside, accumulated in ``compute``, the output rounded to w's dtype; backward casts
    the incoming gradient up and each gradient back to its input's dtype. x and w are saved in their
    own (low) dtypes and cast up again in backward: exact, and half the saved bytes.
    """

    @staticmethod
    def forward(ctx, x, w, b=None, compute=None):
        _check_matmul(x, w)
        ctx.save(x if ctx.needs_grad[1] else None, w if ctx.needs_grad[0] else None)
        if compute is not None:
            ctx.compute, ctx.dtypes = compute, (x.dtype, w.dtype) + (() if b is None else (b.dtype,))
            x, w = x.astype(compute, copy=False), w.astype(compute, copy=False)
            b = None if b is None else b.astype(compute, copy=False)
        y = _rows(x) @ w
        if b is not None:
            y = y + b
        y = y.reshape(x.shape[:-1] + w.shape[1:])
        return y if compute is None else y.astype(ctx.dtypes[1], copy=False)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved
        dtypes = getattr(ctx, "dtypes", None)
        if dtypes is not None:  # (x or w is None when its partner's gradient is not wanted)
            g = g.astype(ctx.compute, copy=False)
            x, w = (None if a is None else a.astype(ctx.compute, copy=False) for a in (x, w))
        G = _rows(g)  # noqa: N806 - the matrix of the docstring
        gx = (G @ w.T).reshape(g.shape[:-1] + w.shape[:1]) if ctx.needs_grad[0] else None
        gw = _rows(x).T @ G if ctx.needs_grad[1] else None
        gb = None
        if len(ctx.needs_grad) > 2 and ctx.needs_grad[2]:
            gb = _xp(g).ones(G.shape[0], dtype=G.dtype) @ G
        return (gx, gw, gb) if dtypes is None else _back_to(dtypes, (gx, gw, gb))


def low_precision(dtype) -> bool:
    """A 2-byte float (bf16, fp16): what ``linear`` multiplies in fp32. (Not ``kind == "f"``:
    ml_dtypes' bfloat16 is kind "V".)"""
    dtype = np.dtype(dtype)
    return dtype.itemsize == 2 and dtype.kind not in "iub"
