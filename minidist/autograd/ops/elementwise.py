"""Elementwise ops: arithmetic with broadcasting in both directions, exp/log/tanh, ReLU, GELU, casts.

Each backward is the derivative of its forward, applied to the incoming gradient ``g``; a binary op
sums its gradient over the axes an input was broadcast along (``unbroadcast``).
"""

from __future__ import annotations

import math

from minidist.autograd.ops.arrays import _shape, _xp, unbroadcast
from minidist.autograd.tensor import Function


class Add(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.shapes = _shape(a), _shape(b)
        return a + b

    @staticmethod
    def backward(ctx, g):
        sa, sb = ctx.shapes
        return (unbroadcast(g, sa) if ctx.needs_grad[0] else None,
                unbroadcast(g, sb) if ctx.needs_grad[1] else None)


class Sub(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.shapes = _shape(a), _shape(b)
        return a - b

    @staticmethod
    def backward(ctx, g):
        sa, sb = ctx.shapes
        return (unbroadcast(g, sa) if ctx.needs_grad[0] else None,
                unbroadcast(-g, sb) if ctx.needs_grad[1] else None)


class Mul(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save(a if ctx.needs_grad[1] else None, b if ctx.needs_grad[0] else None)
        ctx.shapes = _shape(a), _shape(b)
        return a * b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved
        sa, sb = ctx.shapes
        return (unbroadcast(g * b, sa) if ctx.needs_grad[0] else None,
                unbroadcast(g * a, sb) if ctx.needs_grad[1] else None)


class Div(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save(a, b)
        ctx.shapes = _shape(a), _shape(b)
        return a / b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved
        sa, sb = ctx.shapes
        return (unbroadcast(g / b, sa) if ctx.needs_grad[0] else None,
                unbroadcast(-g * a / (b * b), sb) if ctx.needs_grad[1] else None)


class Neg(Function):
    @staticmethod
    def forward(ctx, a):
        return -a

    @staticmethod
    def backward(ctx, g):
        return -g


class Pow(Function):
    """``a ** b``; either may be a plain number (``2.0 ** t`` too); d/db needs ``a`` positive."""

    @staticmethod
    def forward(ctx, a, b):
        out = a ** b
        ctx.save(a, b, out)
        ctx.shapes = _shape(a), _shape(b)
        return out

    @staticmethod
    def backward(ctx, g):
        a, b, out = ctx.saved
        sa, sb = ctx.shapes
        ga = unbroadcast(g * b * a ** (b - 1), sa) if ctx.needs_grad[0] else None
        gb = None
        if ctx.needs_grad[1]:  # a Python-number base is made an array of out's dtype: float32 stays so
            xp = _xp(out)
            log_a = xp.log(a if hasattr(a, "shape") else xp.asarray(a, dtype=out.dtype))
            gb = unbroadcast(g * out * log_a, sb)
        return ga, gb


class Exp(Function):
    @staticmethod
    def forward(ctx, a):
        out = _xp(a).exp(a)
        ctx.save(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved
        return g * out


class Log(Function):
    @staticmethod
    def forward(ctx, a):
        ctx.save(a)
        return _xp(a).log(a)

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved
        return g / a


class Tanh(Function):
    @staticmethod
    def forward(ctx, a):
        out = _xp(a).tanh(a)
        ctx.save(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved
        return g * (1 - out * out)


class Relu(Function):
    @staticmethod
    def forward(ctx, a):
        out = _xp(a).maximum(a, 0)
        ctx.save(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved
        return g * (out > 0)


GELU_C = math.sqrt(2.0 / math.pi)  # c
GELU_K = GELU_C * 0.044715  # k


class Gelu(Function):
    """GELU, tanh approximation (GPT-2): gelu(x) = 0.5·x·(1 + tanh(c·(x + 0.044715·x³))), c = √(2/π).

    Written x·h with h = ½(1 + tanh(u)), u = x·(c + k·x²), k = 0.044715·c. The derivative is
    h + x·h', and h' = ½(1 - tanh²u)·u' = 2·h·(1 - h)·(c + 3k·x²), so gelu'(x) = h + x·(2c + 6k·x²)·h·(1 - h).
    """

    @staticmethod
    def forward(ctx, x):
        h = 0.5 * (_xp(x).tanh((x * x * GELU_K + GELU_C) * x) + 1.0)
        ctx.save(x, h)
        return x * h

    @staticmethod
    def backward(ctx, g):
        x, h = ctx.saved
        return g * ((x * x * (6 * GELU_K) + 2 * GELU_C) * x * ((1.0 - h) * h) + h)


class Cast(Function):
    @staticmethod
    def forward(ctx, a, dtype):
        ctx.dtype = a.dtype
        return a.astype(dtype)

    @staticmethod
    def backward(ctx, g):
        return g.astype(ctx.dtype)
