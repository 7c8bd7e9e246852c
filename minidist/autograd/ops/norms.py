"""Normalisations and dropout: softmax, log-softmax, LayerNorm, inverted dropout.

Softmax's backward is p ⊙ (g - Σ g·p); LayerNorm's is written out in its docstring; dropout's mask
comes from a seeded host generator, so every backend and every split of a layer draws the same one.
"""

from __future__ import annotations

import numpy as np

from minidist.accel.backend import backend_of
from minidist.autograd.ops.arrays import _back_to, _rows, _xp
from minidist.autograd.tensor import Function


def _softmax(x, axis):
    xp = _xp(x)
    e = xp.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


class Softmax(Function):
    @staticmethod
    def forward(ctx, x, axis=-1):
        out = _softmax(x, axis)
        ctx.save(out)
        ctx.axis = axis
        return out

    @staticmethod
    def backward(ctx, g):
        (p,) = ctx.saved
        return p * (g - (g * p).sum(axis=ctx.axis, keepdims=True))


class LogSoftmax(Function):
    @staticmethod
    def forward(ctx, x, axis=-1):
        xp = _xp(x)
        shifted = x - x.max(axis=axis, keepdims=True)
        out = shifted - xp.log(xp.exp(shifted).sum(axis=axis, keepdims=True))
        ctx.save(out)
        ctx.axis = axis
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved
        return g - _xp(g).exp(out) * g.sum(axis=ctx.axis, keepdims=True)


class LayerNorm(Function):
    """y = x̂·w + b over the last axis: x̂ = (x - μ)·rstd, rstd = 1/√(σ² + eps), μ and σ² each row's mean
    and variance.

    Backward, with d = g·w (means over the last axis, sums over every row): dx = rstd·(d - mean(d) -
    x̂·mean(d·x̂)), dw = Σ g·x̂, db = Σ g.

    ``compute`` (mixed precision: float32 for bf16/fp16 parameters): x, w, b are cast to it inside,
    the statistics and the affine run in it, the output is rounded to w's dtype; backward casts the
    incoming gradient up and each gradient back to its input's dtype. The same numbers as casting
    around the op (five ops: three casts in, the norm, one cast out), as one op.
    """

    @staticmethod
    def forward(ctx, x, w, b, eps=1e-5, compute=None):
        if compute is not None:
            ctx.compute, ctx.dtypes = compute, (x.dtype, w.dtype, b.dtype)
            x, w, b = (a.astype(compute, copy=False) for a in (x, w, b))
        xc = x - x.mean(axis=-1, keepdims=True)
        var = (xc * xc).mean(axis=-1, keepdims=True)
        rstd = 1.0 / _xp(x).sqrt(var + eps)
        xhat = xc * rstd
        ctx.save(xhat, rstd, w)
        out = xhat * w + b
        return out if compute is None else out.astype(ctx.dtypes[1], copy=False)

    @staticmethod
    def backward(ctx, g):
        xhat, rstd, w = ctx.saved
        dtypes = getattr(ctx, "dtypes", None)
        if dtypes is not None:
            g = g.astype(ctx.compute, copy=False)
        d = g * w
        gx = rstd * (d - d.mean(axis=-1, keepdims=True) - xhat * (d * xhat).mean(axis=-1, keepdims=True))
        gw, gb = _rows(g * xhat).sum(axis=0), _rows(g).sum(axis=0)
        return (gx, gw, gb) if dtypes is None else _back_to(dtypes, (gx, gw, gb))


def layer_norm_compute(compute, x, w, b):
    """The dtype ``compute`` names for ``LayerNorm``'s statistics, or None where x, w and b are in it
    already (then the op without casts: the same numbers, one compiled program fewer on JAX). Refused
    unless x, w and b cast to it without loss (float16 is as wide as bfloat16 in bytes, not in range)."""
    try:
        dt = np.dtype(compute)
    except TypeError:
        dt = np.dtype(object)  # (refused below)
    if x.dtype == w.dtype == b.dtype == dt:
        return None
    if dt.kind != "f" or not all(np.can_cast(a.dtype, dt, "safe") for a in (x, w, b)):
        widest = np.result_type(np.float32, x.dtype, w.dtype, b.dtype)
        raise ValueError(f"layer_norm: compute={compute!r} must be a float dtype x, w and b ({x.dtype}, "
                         f"{w.dtype}, {b.dtype}) cast to without loss, e.g. {widest}")
    return dt


def dropout_mask(shape, p, rng, dtype):
    """A host array: 1/(1-p) where an element is kept, 0 where dropped (probability p), from ``rng``."""
    keep = rng.random(tuple(shape), dtype="float32") >= p
    return keep.astype(dtype) * (1.0 / (1.0 - p))


class Dropout(Function):
    """Zero each element with probability p, scale survivors by 1/(1-p); the mask comes from ``rng``."""

    @staticmethod
    def forward(ctx, x, p, rng):
        mask = backend_of(x).from_host(dropout_mask(x.shape, p, rng, x.dtype))
        ctx.save(mask)
        return x * mask

    @staticmethod
    def backward(ctx, g):
        (mask,) = ctx.saved
        return g * mask
