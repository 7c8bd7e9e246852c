"""Differentiable primitives: each op's forward and backward side by side.

Every op is a ``Function`` subclass working on raw backend arrays (``xp`` is NumPy, CuPy or
jax.numpy, found from the arrays themselves), plus a lower-case wrapper that takes Tensors.
Backward formulas are written out, not derived by a tracer, so a reader can check each one
against the textbook: every op here is that formula in plain ``xp`` code, nothing else.

The ops a model spends its time in (``linear``, ``gelu``, ``layer_norm``, the two attentions,
``cross_entropy``) are fused -- one op, saving only what their backward needs -- and have a second,
fast form in ``minidist.autograd.fused`` (in-place chains, BLAS sums) with the same contract. Their
lower-case wrappers run the class ``fused.fast(Op, x)`` picks: the fast form on NumPy and CuPy, the
one here on JAX or under ``MINIDIST_FUSED=0`` / ``fused.disabled()``.
"""

from __future__ import annotations

import builtins
import math

import numpy as np

from minidist.accel.backend import backend_of, compiles_per_shape, to_host
from minidist.autograd.tensor import Function, Tensor


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


# ---------------------------------------------------------------------------------------------
# elementwise arithmetic (with broadcasting in both directions)
# ---------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------
# matrix products
# ---------------------------------------------------------------------------------------------
def _rows(a):
    """``a`` as a matrix (every leading axis folded into rows); unlike ``reshape(-1, n)`` it works
    when the last axis is 0."""
    return a.reshape(math.prod(a.shape[:-1]), a.shape[-1])


def _back_to(dtypes, grads) -> tuple:
    """Each gradient in its input's dtype (the backward of an op that computed in a wider
    ``compute`` dtype); None stays None."""
    return tuple(None if g is None else g.astype(dt, copy=False) for g, dt in zip(grads, dtypes))


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
        return a @ b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved
        xp = _xp(g)
        ga = gb = None
        if ctx.needs_grad[0]:
            if b.ndim == 1:
                ga = g[..., None] * b
            elif a.ndim == 1:
                ga = _rows(g[..., None, :] @ xp.swapaxes(b, -1, -2)).sum(axis=0)
            else:
                ga = unbroadcast(g @ xp.swapaxes(b, -1, -2), a.shape)
        if ctx.needs_grad[1]:
            if b.ndim == 2 and a.ndim >= 2:  # a weight: fold the batch axes into one big product
                gb = _rows(a).T @ _rows(g)
            elif a.ndim == 1 and b.ndim == 1:  # a dot product: g is 0-d
                gb = g * a
            elif a.ndim == 1:
                gb = unbroadcast(a[:, None] * g[..., None, :], b.shape)
            elif b.ndim == 1:
                gb = _rows(a * g[..., None]).sum(axis=0)
            else:
                gb = unbroadcast(xp.swapaxes(a, -1, -2) @ g, b.shape)
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


# ---------------------------------------------------------------------------------------------
# reductions
# ---------------------------------------------------------------------------------------------
def _axes(axis, ndim):
    if axis is None:
        return tuple(range(ndim))
    axis = (axis,) if isinstance(axis, int) else tuple(axis)
    return tuple(a % ndim for a in axis) if ndim else ()


def _expand(g, axes, shape, keepdims):
    if not keepdims:
        for a in sorted(axes):
            g = _xp(g).expand_dims(g, a)
    return _xp(g).broadcast_to(g, shape)


class Sum(Function):
    @staticmethod
    def forward(ctx, a, axis=None, keepdims=False):
        ctx.axes, ctx.shape, ctx.keepdims = _axes(axis, a.ndim), a.shape, keepdims
        return a.sum(axis=ctx.axes, keepdims=keepdims)

    @staticmethod
    def backward(ctx, g):
        return _expand(g, ctx.axes, ctx.shape, ctx.keepdims)


class Mean(Function):
    @staticmethod
    def forward(ctx, a, axis=None, keepdims=False):
        ctx.axes, ctx.shape, ctx.keepdims = _axes(axis, a.ndim), a.shape, keepdims
        ctx.n = math.prod(a.shape[i] for i in ctx.axes)
        return a.mean(axis=ctx.axes, keepdims=keepdims)

    @staticmethod
    def backward(ctx, g):
        return _expand(g / ctx.n, ctx.axes, ctx.shape, ctx.keepdims)


class Max(Function):
    """Max over axes; ties share the gradient equally (as ``torch.amax`` does)."""

    @staticmethod
    def forward(ctx, a, axis=None, keepdims=False):
        axes = _axes(axis, a.ndim)
        out = a.max(axis=axes, keepdims=True)
        mask = (a == out).astype(a.dtype)
        ctx.save(mask / mask.sum(axis=axes, keepdims=True))
        ctx.axes, ctx.shape, ctx.keepdims = axes, a.shape, keepdims
        return out if keepdims else out.reshape(tuple(n for i, n in enumerate(a.shape) if i not in axes))

    @staticmethod
    def backward(ctx, g):
        (share,) = ctx.saved
        return _expand(g, ctx.axes, ctx.shape, ctx.keepdims) * share


# ---------------------------------------------------------------------------------------------
# shapes, indexing, joining
# ---------------------------------------------------------------------------------------------
class Reshape(Function):
    @staticmethod
    def forward(ctx, a, shape):
        ctx.shape = a.shape
        return a.reshape(shape)

    @staticmethod
    def backward(ctx, g):
        return g.reshape(ctx.shape)


class Transpose(Function):
    @staticmethod
    def forward(ctx, a, axes=None):
        axes = tuple(reversed(range(a.ndim))) if axes is None else tuple(ax % a.ndim for ax in axes)
        ctx.inverse = tuple(sorted(range(len(axes)), key=axes.__getitem__))
        return _xp(a).transpose(a, axes)

    @staticmethod
    def backward(ctx, g):
        return _xp(g).transpose(g, ctx.inverse)


def _is_basic_index(idx) -> bool:
    idx = idx if isinstance(idx, tuple) else (idx,)
    return all(isinstance(i, (int, slice)) or i is None or i is Ellipsis for i in idx)


class GetItem(Function):
    """``a[idx]``: slices, integers and integer/boolean arrays; repeated indices accumulate."""

    @staticmethod
    def forward(ctx, a, idx):
        ctx.idx, ctx.shape, ctx.dtype = idx, a.shape, a.dtype
        return a[idx]

    @staticmethod
    def backward(ctx, g):
        be = backend_of(g)
        out = be.xp.zeros(ctx.shape, dtype=ctx.dtype)
        if be.inplace and _is_basic_index(ctx.idx):
            out[ctx.idx] = g
            return out
        return be.scatter_add(out, ctx.idx, g)


class Concat(Function):
    @staticmethod
    def forward(ctx, *arrays, axis=0):
        ctx.axis = axis
        ctx.sizes = [a.shape[axis] for a in arrays]
        return _xp(arrays[0]).concatenate(arrays, axis=axis)

    @staticmethod
    def backward(ctx, g):
        bounds, start = [], 0
        for n in ctx.sizes[:-1]:
            start += n
            bounds.append(start)
        return tuple(_xp(g).split(g, bounds, axis=ctx.axis))


class Embedding(Function):
    """Rows of ``weight`` picked by integer ``idx``; backward scatter-adds (repeated ids add up)."""

    @staticmethod
    def forward(ctx, weight, idx):
        idx = _xp(weight).asarray(idx)  # host ids (NumPy) onto the table's device: CuPy won't mix them
        ctx.idx, ctx.shape = idx, weight.shape
        return weight[idx]

    @staticmethod
    def backward(ctx, g):
        # scatter-add element by element into the flat (V·D,) gradient: row i, column j of the table
        # is element i·D + j. NumPy's add.at is ~6x faster on a flat index than on rows of a matrix.
        be = backend_of(g)
        xp, d = be.xp, ctx.shape[-1]
        rows = ctx.idx.reshape(-1, 1)
        if be.inplace:
            rows = rows.astype(np.intp)  # i·D must not overflow an int32 id
        flat = (rows * d + xp.arange(d)).reshape(-1)
        out = be.scatter_add(xp.zeros(ctx.shape[0] * d, dtype=g.dtype), flat, g.reshape(-1))
        return out.reshape(ctx.shape), None


# ---------------------------------------------------------------------------------------------
# normalisations and losses
# ---------------------------------------------------------------------------------------------
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


def causal_hidden(q, k):
    """The scores a causal mask hides: with ``q`` shorter than ``k`` (decoding with a KV cache)
    query i sits at key position Tk - Tq + i and sees keys up to and including it."""
    xp, tq, tk = _xp(q), q.shape[-2], k.shape[-2]
    return xp.arange(tk)[None, :] > (xp.arange(tq)[:, None] + (tk - tq))


def attention_probs(q, k, causal):
    """p = softmax(q·kᵀ/√d + causal mask) over the keys."""
    xp = _xp(q)
    s = (q @ xp.swapaxes(k, -1, -2)) * q.dtype.type(1.0 / math.sqrt(q.shape[-1]))
    if causal and k.shape[-2] > 1:
        s = xp.where(causal_hidden(q, k), xp.asarray(-xp.inf, dtype=s.dtype), s)
    return _softmax(s, -1)


def attention_grads(q, k, v, p, g):
    """(dq, dk, dv) of y = p·v, for the gradient g of y: dv = pᵀ·g; dp = g·vᵀ; the scores' gradient
    ds = p ⊙ (dp - Σ_j p·dp) (softmax's backward), over √d: dq = ds·k, dk = dsᵀ·q."""
    xp = _xp(g)
    dp = g @ xp.swapaxes(v, -1, -2)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True)) * q.dtype.type(1.0 / math.sqrt(q.shape[-1]))
    return ds @ k, xp.swapaxes(ds, -1, -2) @ q, xp.swapaxes(p, -1, -2) @ g


class ScaledDotProductAttention(Function):
    """softmax(q·kᵀ/√d + causal mask)·v over (batch, heads, time, head_dim) as one op.

    ``q`` may be shorter than ``k``/``v`` (decoding with a KV cache): query i sits at key position
    ``Tk - Tq + i`` and sees keys up to and including it.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal=True):
        p = attention_probs(q, k, causal)
        ctx.save(q, k, v, p)
        return p @ v

    @staticmethod
    def backward(ctx, g):
        q, k, v, p = ctx.saved
        return attention_grads(q, k, v, p, g)


def _heads(qkv, n_head):
    """q, k, v as (B, H, T, D) strided views of the fused projections qkv (B, T, 3·H·D): no copy,
    and BLAS multiplies such views in place (each (T, D) matrix has unit stride along D)."""
    b, t, three_c = qkv.shape
    parts = qkv.reshape(b, t, 3, n_head, three_c // (3 * n_head))
    return tuple(_xp(qkv).moveaxis(parts[:, :, i], 2, 1) for i in range(3))


def merge_heads(y):
    """(B, H, T, D) -> (B, T, H·D)."""
    return _xp(y).moveaxis(y, 1, 2).reshape(y.shape[0], y.shape[2], -1)


def split_heads(g, n_head):
    """(B, T, H·D) -> (B, H, T, D) (a view)."""
    b, t, c = g.shape
    return _xp(g).moveaxis(g.reshape(b, t, n_head, c // n_head), 2, 1)


def pack_heads(dq, dk, dv):
    """Three (B, H, T, D) gradients as one (B, T, 3·H·D), qkv's layout: stacked as (B, T, 3, H, D)."""
    xp, (b, _, t, _) = _xp(dq), dq.shape
    return xp.stack([xp.moveaxis(a, 1, 2) for a in (dq, dk, dv)], axis=2).reshape(b, t, -1)


class PackedAttention(Function):
    """Self-attention (causal by default) of the fused projections qkv (B, T, 3·H·D) to (B, T, H·D):
    the heads are split and merged inside the op (flash-attn's "qkvpacked" form), with the math of
    ``ScaledDotProductAttention``.

    Why one op: split into q, k, v by three indexing ops, qkv's gradient would be three zero-filled
    (B, T, 3·H·D) arrays, each with one third written, added up, then copied back from the heads'
    layout. Here backward stacks dq, dk, dv into one array, once.
    """

    @staticmethod
    def forward(ctx, qkv, n_head, causal=True):
        q, k, v = _heads(qkv, n_head)
        p = attention_probs(q, k, causal)
        ctx.save(qkv, p)
        ctx.n_head = n_head
        return merge_heads(p @ v)

    @staticmethod
    def backward(ctx, g):
        qkv, p = ctx.saved
        return pack_heads(*attention_grads(*_heads(qkv, ctx.n_head), p, split_heads(g, ctx.n_head)))


def ce_rows(logits, targets, ignore_index):
    """(logits as rows (N, V), each row's target or 0 where ignored, which rows count)."""
    xp = _xp(logits)
    t = xp.asarray(targets).reshape(-1)  # host targets onto the logits' device (CuPy won't mix)
    valid = t != ignore_index
    return logits.reshape(-1, logits.shape[-1]), xp.where(valid, t, 0), valid


class CrossEntropy(Function):
    """Mean negative log-likelihood of integer ``targets`` under ``logits`` (last axis = classes).

    With e = exp(x - max x) and s = Σ e per row, the loss is log s - (x_t - max x), and the gradient
    (softmax - one_hot)·g/n = e·(g/n)/s, minus g/n at each target. Forward keeps e and s, so backward
    is one pass over the logits and one write per row. Targets equal to ``ignore_index`` contribute
    nothing and are not counted in n.
    """

    @staticmethod
    def forward(ctx, logits, targets, ignore_index=-1):
        x, t, valid = ce_rows(logits, targets, ignore_index)
        shifted = x - x.max(axis=-1, keepdims=True)
        logit_t = _xp(x).take_along_axis(shifted, t[:, None], axis=-1)[:, 0]  # x_t - max x
        e = _xp(x).exp(shifted)
        return CrossEntropy.finish(ctx, logits, logit_t, e, e.sum(axis=-1, keepdims=True), t, valid)

    @staticmethod
    def finish(ctx, logits, logit_t, e, s, t, valid):
        """The mean of log s - (x_t - max x) over the rows that count; keeps e and s for backward."""
        xp = _xp(e)
        total = ((xp.log(s[:, 0]) - logit_t) * valid).sum()
        # the count stays an array (no host read-back, so the op compiles on JAX), in the loss's
        # dtype: what dividing by a Python int does on NumPy, so the result is the same bits
        n = xp.maximum(valid.sum(), 1).astype(total.dtype)
        ctx.save(e, s)
        ctx.t, ctx.valid, ctx.n, ctx.shape = t, valid, n, logits.shape
        return (total / n).astype(logits.dtype)

    @staticmethod
    def backward(ctx, g):
        e, s = ctx.saved
        be = backend_of(e)
        scale = (g / ctx.n) * ctx.valid.astype(e.dtype)  # per row: g/n, or 0 where ignored
        grad = e * (scale[:, None] / s)
        grad = be.scatter_add(grad, (be.xp.arange(grad.shape[0]), ctx.t), -scale)
        return grad.reshape(ctx.shape), None


# ---------------------------------------------------------------------------------------------
# the Tensor-level API
# ---------------------------------------------------------------------------------------------
def _data(x):
    return x.data if isinstance(x, Tensor) else x


def add(a, b):
    return Add.apply(a, b)


def sub(a, b):
    return Sub.apply(a, b)


def mul(a, b):
    return Mul.apply(a, b)


def div(a, b):
    return Div.apply(a, b)


def neg(a):
    return Neg.apply(a)


def pow(a, b):  # noqa: A001 - the op's name
    return Pow.apply(a, b)


def exp(a):
    return Exp.apply(a)


def log(a):
    return Log.apply(a)


def tanh(a):
    return Tanh.apply(a)


def relu(a):
    return Relu.apply(a)


def gelu(a):
    return fused.fast(Gelu, a).apply(a)


def cast(a, dtype):
    return Cast.apply(a, dtype=dtype)


def matmul(a, b):
    return Matmul.apply(a, b)


def low_precision(dtype) -> bool:
    """A 2-byte float (bf16, fp16): what ``linear`` multiplies in fp32. (Not ``kind == "f"``:
    ml_dtypes' bfloat16 is kind "V".)"""
    dtype = np.dtype(dtype)
    return dtype.itemsize == 2 and dtype.kind not in "iub"


def linear(x, w, b=None):
    """``x @ w + b``. With 2-byte float weights (bf16, fp16: mixed precision) the product runs as a
    tensor core does it: inputs cast up, accumulated in fp32, the output rounded once to ``w``'s
    dtype (gradients likewise), so every layer that multiplies -- serial or tensor-parallel -- gets
    the same low-precision arithmetic without being patched."""
    op = fused.fast(Linear, x)
    if low_precision(w.dtype):  # (one op: the casts happen inside it)
        return op.apply(x, w, b, compute=np.dtype(np.float32)) if b is not None else \
            op.apply(x, w, compute=np.dtype(np.float32))
    return op.apply(x, w, b) if b is not None else op.apply(x, w)


def sum(a, axis=None, keepdims=False):  # noqa: A001
    return Sum.apply(a, axis=axis, keepdims=keepdims)


def mean(a, axis=None, keepdims=False):
    return Mean.apply(a, axis=axis, keepdims=keepdims)


def max(a, axis=None, keepdims=False):  # noqa: A001
    return Max.apply(a, axis=axis, keepdims=keepdims)


def reshape(a, shape):
    return Reshape.apply(a, shape=tuple(shape))


def transpose(a, axes=None):
    return Transpose.apply(a, axes=axes)


def getitem(a, idx):
    if isinstance(idx, Tensor):
        idx = idx.data
    elif isinstance(idx, tuple):
        idx = tuple(i.data if isinstance(i, Tensor) else i for i in idx)
    return GetItem.apply(a, idx=idx)


def concat(tensors, axis=0):
    return Concat.apply(*tensors, axis=axis)


def split(a, sections, axis=0):
    """Split ``a`` along ``axis`` into ``sections`` equal parts (an int) or at the given sizes."""
    n = a.shape[axis]
    if isinstance(sections, int):
        if n % sections:
            raise ValueError(f"split: axis {axis} of length {n} doesn't divide into {sections} parts")
        sizes = [n // sections] * sections
    else:
        sizes = list(sections)
        if builtins.sum(sizes) != n:
            raise ValueError(f"split: sizes {sizes} don't add up to axis {axis} length {n}")
    out, start = [], 0
    for s in sizes:
        idx = (slice(None),) * (axis % a.ndim) + (slice(start, start + s),)
        out.append(getitem(a, idx))
        start += s
    return out


def _check_ids(ids, n: int, what: str, ignore=None):
    """Integer ``ids`` in [0, n) (or equal to ``ignore``), else a ValueError naming the first bad one:
    NumPy would index from the end for -1 and fail deep inside for n."""
    if getattr(getattr(ids, "dtype", None), "kind", "") not in ("i", "u"):
        raise TypeError(f"{what} must be an integer array, got {getattr(ids, 'dtype', type(ids).__name__)}")
    if compiles_per_shape(backend_of(ids)):
        # JAX: one copy to the host and the check there; on the device it was ~5 small compiled
        # programs (<, >=, |, any) per shape and a read-back of its answer anyway
        ids = to_host(ids)
    bad = (ids < 0) | (ids >= n)
    if ignore is not None:
        bad = bad & (ids != ignore)
    if bool(bad.any()):
        be = backend_of(ids)
        first = be.to_host(ids)[be.to_host(bad)][0]
        extra = f" or {ignore} (ignored)" if ignore is not None else ""
        raise ValueError(f"{what} holds {int(first)}: ids must be in [0, {n}){extra}")


def embedding(weight, idx):
    idx = _data(idx)
    _check_ids(idx, weight.shape[0], "embedding: token id array")
    return Embedding.apply(weight, idx)


def softmax(x, axis=-1):
    return Softmax.apply(x, axis=axis)


def log_softmax(x, axis=-1):
    return LogSoftmax.apply(x, axis=axis)


def layer_norm(x, w, b, eps=1e-5, compute=None):
    """LayerNorm over the last axis; ``compute`` (e.g. float32 under bf16 parameters): the dtype its
    statistics run in, the output rounded to ``w``'s dtype (see ``LayerNorm``). Everything already in
    ``compute``: the op without casts (the same numbers, one compiled program fewer on JAX)."""
    if compute is None:
        return fused.fast(LayerNorm, x).apply(x, w, b, eps=eps)
    try:
        dt = np.dtype(compute)
    except TypeError:
        dt = np.dtype(object)  # (refused below)
    if x.dtype == w.dtype == b.dtype == dt:
        return fused.fast(LayerNorm, x).apply(x, w, b, eps=eps)
    if dt.kind != "f" or not all(np.can_cast(a.dtype, dt, "safe") for a in (x, w, b)):
        # (safe casts only: float16 is as wide as bfloat16 in bytes, not in range -- 1e5 became inf)
        widest = np.result_type(np.float32, x.dtype, w.dtype, b.dtype)
        raise ValueError(f"layer_norm: compute={compute!r} must be a float dtype x, w and b ({x.dtype}, "
                         f"{w.dtype}, {b.dtype}) cast to without loss, e.g. {widest}")
    return fused.fast(LayerNorm, x).apply(x, w, b, eps=eps, compute=dt)


def dropout(x, p, rng, training=True):
    """Inverted dropout with a seeded NumPy generator ``rng``; identity when p == 0 or not training."""
    if not training or p == 0.0:
        return x
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    return Dropout.apply(x, p=p, rng=rng)


def scaled_dot_product_attention(q, k, v, causal=True):
    return fused.fast(ScaledDotProductAttention, q).apply(q, k, v, causal=causal)


def packed_attention(qkv, n_head, causal=True):
    """Self-attention of fused projections qkv (B, T, 3·H·D) over ``n_head`` heads: (B, T, H·D)."""
    check_packed(qkv, n_head, "packed_attention")
    return fused.fast(PackedAttention, qkv).apply(qkv, n_head=n_head, causal=causal)


def check_packed(qkv, n_head: int, what: str) -> None:
    """qkv must be (batch, time, 3·n_head·head_dim): the fused projections an attention unpacks."""
    if len(qkv.shape) != 3 or n_head < 1 or qkv.shape[-1] % (3 * n_head):
        raise ValueError(f"{what}: qkv of shape {tuple(qkv.shape)} with n_head={n_head}: need "
                         f"(batch, time, 3·n_head·head_dim), the last axis a multiple of 3·n_head")


def cross_entropy(logits, targets, ignore_index=-1):
    targets = _data(targets)
    _check_ids(targets, logits.shape[-1], "cross_entropy: targets", ignore=ignore_index)
    return fused.fast(CrossEntropy, logits).apply(logits, targets, ignore_index=ignore_index)


from minidist.autograd import fused  # noqa: E402 - the fast forms subclass the ops above
