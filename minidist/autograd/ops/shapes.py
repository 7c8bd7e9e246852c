"""Reductions, shapes, indexing and joining: sum/mean/max, reshape, transpose, a[idx], concat, split,
embedding.

A reduction's backward spreads the gradient back over the axes it summed (``_expand``); an indexing
op's backward writes (or scatter-adds, where indices repeat) the gradient into zeros of the input's
shape. ``_check_ids`` refuses integer ids out of range before a lookup uses them.
"""

from __future__ import annotations

import math

import numpy as np

from minidist.accel.backend import backend_of, compiles_per_shape, to_host
from minidist.autograd.ops.arrays import _xp
from minidist.autograd.tensor import Function


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


def split(a, sections, axis=0):
    """Split Tensor ``a`` along ``axis`` into ``sections`` equal parts (an int) or at the given sizes:
    one ``GetItem`` per part (``Concat`` joins them back)."""
    n = a.shape[axis]
    if isinstance(sections, int):
        if n % sections:
            raise ValueError(f"split: axis {axis} of length {n} doesn't divide into {sections} parts")
        sizes = [n // sections] * sections
    else:
        sizes = list(sections)
        if sum(sizes) != n:
            raise ValueError(f"split: sizes {sizes} don't add up to axis {axis} length {n}")
    out, start = [], 0
    for s in sizes:
        idx = (slice(None),) * (axis % a.ndim) + (slice(start, start + s),)
        out.append(GetItem.apply(a, idx=idx))
        start += s
    return out


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
