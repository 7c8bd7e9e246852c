"""The array helpers every op shares: its array library, and the shapes its gradients must take.

``_xp(a)`` is the namespace of ``a``'s backend (NumPy, CuPy or jax.numpy), found from the array
itself, so one op's code runs on all three. ``unbroadcast`` undoes broadcasting in a gradient;
``_rows`` folds leading axes into the rows of a matrix; ``_back_to`` returns gradients computed in a
wider ``compute`` dtype to their inputs' dtypes (mixed precision).
"""

from __future__ import annotations

import math

from minidist.accel.backend import backend_of


def _xp(a):
    return backend_of(a).xp


def unbroadcast(grad, shape):
    """Sum ``grad`` over the axes along which an input of ``shape`` was broadcast."""
    if tuple(grad.shape) == tuple(shape):
        return grad
    extra = grad.ndim - len(shape)
    axes = tuple(range(extra)) + tuple(i + extra for i, n in enumerate(shape) if n == 1
                                       and grad.shape[i + extra] != 1)
    return grad.sum(axis=axes, keepdims=True).reshape(shape) if axes else grad.reshape(shape)


def _shape(x):
    return tuple(x.shape) if hasattr(x, "shape") else ()


def _rows(a):
    """``a`` as a matrix (every leading axis folded into rows); unlike ``reshape(-1, n)`` it works
    when the last axis is 0."""
    return a.reshape(math.prod(a.shape[:-1]), a.shape[-1])


def _back_to(dtypes, grads) -> tuple:
    """Each gradient in its input's dtype (the backward of an op that computed in a wider
    ``compute`` dtype); None stays None."""
    return tuple(None if g is None else g.astype(dt, copy=False) for g, dt in zip(grads, dtypes))
