"""The fast forms of the ops a training step spends its time in, registered in ``ops.FAST``.

``ops/`` writes each op once, as its textbook formula. This file rewrites the few that dominate a
step so that NumPy does less work, with the same contract (inputs, outputs, gradients); each
subclasses its plain op (same name, so a graph reads the same) and says ``compilable = True``, so
the JAX engine compiles it like the op it replaces. Importing this module registers them (the
``minidist`` package does); ``ops.fast`` picks them, ``MINIDIST_FUSED=0`` or ``ops.disabled()`` not.

* ``Gelu``: the formula as a chain of in-place updates of one fresh temporary (``_inplace``): the
  same operations in the same order, so the same bits as ``ops.Gelu``.
* ``Linear``: the bias added in place; a single matrix (one token while decoding) skips the reshapes.
* ``LayerNorm``, the two attentions, ``CrossEntropy``: every sum over a short last axis is a BLAS
  matrix-vector product (``_sum_last``, ``_dot_last``, ``_vdot_last``), the softmax is computed in
  the scores' own buffer, and one product g·x̂ serves both dw and the row mean. Sums run in another
  order than ``ops``: a few ulps apart (tests/autograd/test_fused.py states the bounds).

NumPy makes one memory pass per operator, so these forms count passes; lessons/01-train.md gives
what each saves. A compiled backend (JAX) fuses the plain formula itself: there ``fast`` keeps it.
"""

from __future__ import annotations

import math

import numpy as np

from minidist.accel.backend import backend_of
from minidist.autograd import ops
from minidist.autograd.ops import FAST, disabled, enabled, fast  # noqa: F401 - the selection, importable here too
from minidist.autograd.ops.arrays import _back_to, _rows, _xp
from minidist.autograd.ops.attention import _heads, causal_hidden, merge_heads, pack_heads, split_heads
from minidist.autograd.ops.elementwise import GELU_C, GELU_K
from minidist.autograd.ops.loss import ce_rows
from minidist.autograd.ops.matmul import _check_matmul


def _inplace(fn, a):
    """``fn(a)`` written over ``a`` (a fresh temporary) where the backend allows it (NumPy, CuPy);
    a new array on JAX. Augmented assignments (``a *= b``) need no such helper: on an immutable
    JAX array they rebind the name to a new array, on NumPy they update the temporary in place.
    A NumPy scalar (what 0-d arithmetic returns) has no buffer to write, so it gets a new one too."""
    return fn(a, out=a) if backend_of(a).inplace and not isinstance(a, np.generic) else fn(a)


def _dot_last(a, v):
    """Σ_i a[..., i]·v[i] over the last axis, keepdims: one matrix-vector product (float32/64: a
    BLAS pass with no temporary); 2-byte floats as a mean does, accumulated in float32."""
    if a.dtype.itemsize < 4:
        return _mean_last(a * v) * a.shape[-1]
    return (_rows(a) @ v).reshape(a.shape[:-1] + (1,))


def _sum_last(a):
    """``a.sum(axis=-1, keepdims=True)``; float32/64 as a matrix-vector product with ones (NumPy's
    ``sum`` along a short last axis costs several times the BLAS pass)."""
    if a.dtype.itemsize < 4:
        return a.sum(axis=-1, keepdims=True)
    return _dot_last(a, _xp(a).ones(a.shape[-1], dtype=a.dtype))


def _mean_last(a):
    """``a.mean(axis=-1, keepdims=True)`` as the sum above over n (2-byte floats: ``mean``, which
    accumulates in float32)."""
    if a.dtype.itemsize < 4:
        return a.mean(axis=-1, keepdims=True)
    return _sum_last(a) / a.shape[-1]


def _vdot_last(a, b):
    """Σ_i a[..., i]·b[..., i] over the last axis, keepdims; float32/64 by ``einsum``, one pass with
    no a·b temporary."""
    if a.dtype.itemsize < 4:
        return (a * b).sum(axis=-1, keepdims=True)
    return _xp(a).einsum("...i,...i->...", a, b)[..., None]


def _sum_rows(a):
    """Σ over every leading axis, (..., n) -> (n,): ``ops.Linear``'s 1ᵀ·G, and 2-byte floats by
    ``sum`` (a ones-vector product would accumulate in 2 bytes)."""
    rows = _rows(a)
    if a.dtype.itemsize < 4:
        return rows.sum(axis=0)
    return _xp(a).ones(rows.shape[0], dtype=a.dtype) @ rows


class Gelu(ops.Gelu):
    """``ops.Gelu``'s h and its derivative, each a chain of updates of one fresh temporary."""

    compilable = True

    @staticmethod
    def forward(ctx, x):
        h = x * x
        h *= GELU_K
        h += GELU_C
        h *= x
        h = _inplace(_xp(x).tanh, h)
        h += 1.0
        h *= 0.5
        ctx.save(x, h)
        return x * h

    @staticmethod
    def backward(ctx, g):
        x, h = ctx.saved
        d = x * x
        d *= 6 * GELU_K
        d += 2 * GELU_C
        d *= x
        hh = 1.0 - h
        hh *= h
        d *= hh
        d += h
        d *= g
        return d


class Linear(ops.Linear):
    """``ops.Linear`` with the bias added into the product's buffer, and no reshape of a single
    matrix; a (B, T, in) input is folded into one GEMM as there (NumPy's batched matmul runs B
    smaller ones, slower)."""

    compilable = True

    @staticmethod
    def forward(ctx, x, w, b=None, compute=None):
        _check_matmul(x, w)
        ctx.save(x if ctx.needs_grad[1] else None, w if ctx.needs_grad[0] else None)
        if compute is not None:
            ctx.compute, ctx.dtypes = compute, (x.dtype, w.dtype) + (() if b is None else (b.dtype,))
            x, w = x.astype(compute, copy=False), w.astype(compute, copy=False)
            b = None if b is None else b.astype(compute, copy=False)
        out = (_rows(x) @ w).reshape(x.shape[:-1] + w.shape[1:]) if _stacked(x, w) else x @ w
        if b is not None:
            if backend_of(out).inplace:
                out += b
            else:
                out = out + b
        return out if compute is None else out.astype(ctx.dtypes[1], copy=False)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved
        dtypes = getattr(ctx, "dtypes", None)
        if dtypes is not None:  # (x or w is None when its partner's gradient is not wanted)
            g = g.astype(ctx.compute, copy=False)
            x, w = (None if a is None else a.astype(ctx.compute, copy=False) for a in (x, w))
        gx = None
        if ctx.needs_grad[0]:
            gx = (_rows(g) @ w.T).reshape(g.shape[:-1] + w.shape[:1]) if _stacked(g, w) else g @ w.T
        gw = _rows(x).T @ _rows(g) if ctx.needs_grad[1] else None
        gb = _sum_rows(g) if len(ctx.needs_grad) > 2 and ctx.needs_grad[2] else None
        return (gx, gw, gb) if dtypes is None else _back_to(dtypes, (gx, gw, gb))


def _stacked(a, w) -> bool:
    """Would ``a @ w`` run several GEMMs (a stack of matrices times one matrix)? Then fold the stack
    into rows: one GEMM. A single matrix skips the reshapes."""
    return w.ndim == 2 and a.ndim > 2 and math.prod(a.shape[:-2]) > 1


class LayerNorm(ops.LayerNorm):
    """``ops.LayerNorm`` counted in passes: every sum a BLAS matrix-vector product (the row means
    Σ_i g_i·w_i and Σ_i (g·x̂)_i·w_i, the column sums dw = Σ g·x̂ and db = Σ g), x̂ built in the
    centred input's buffer, and the one product g·x̂ serving both dw and the second mean."""

    compilable = True

    @staticmethod
    def forward(ctx, x, w, b, eps=1e-5, compute=None):
        if compute is not None:
            ctx.compute, ctx.dtypes = compute, (x.dtype, w.dtype, b.dtype)
            x, w, b = (a.astype(compute, copy=False) for a in (x, w, b))
        xhat = x - _mean_last(x)
        if x.dtype.itemsize < 4:  # (mean accumulates in float32; a 2-byte Σ x̂² could overflow)
            var = _mean_last(xhat * xhat)
        else:
            var = _vdot_last(xhat, xhat) / x.shape[-1]
        rstd = 1.0 / _xp(x).sqrt(var + eps)
        xhat *= rstd
        ctx.save(xhat, rstd, w)
        out = xhat * w
        out += b
        return out if compute is None else out.astype(ctx.dtypes[1], copy=False)

    @staticmethod
    def backward(ctx, g):
        xhat, rstd, w = ctx.saved
        dtypes = getattr(ctx, "dtypes", None)
        if dtypes is not None:
            g = g.astype(ctx.compute, copy=False)
        n = xhat.shape[-1]
        gb = _sum_rows(g) if ctx.needs_grad[2] else None
        gxhat = g * xhat
        gw = _sum_rows(gxhat) if ctx.needs_grad[1] else None
        gx = None
        if ctx.needs_grad[0]:
            proj = xhat * (_dot_last(gxhat, w) / n)  # x̂·mean(d·x̂)
            gx = g * w
            gx -= _dot_last(g, w) / n  # mean(d)
            gx -= proj
            gx *= rstd
        return (gx, gw, gb) if dtypes is None else _back_to(dtypes, (gx, gw, gb))


def _attention_probs(q, k, causal):
    """``ops.attention_probs`` in the scores' own buffer: the mask written in place, then
    exp(scale·(s - max s)) / sum (scale > 0 keeps the max where it is)."""
    be = backend_of(q)
    xp = be.xp
    s = q @ xp.swapaxes(k, -1, -2)
    if causal and k.shape[-2] > 1:
        minus_inf = xp.asarray(-xp.inf, dtype=s.dtype)
        if be.inplace:
            xp.copyto(s, minus_inf, where=causal_hidden(q, k))
        else:
            s = xp.where(causal_hidden(q, k), minus_inf, s)
    s -= s.max(axis=-1, keepdims=True)
    s *= q.dtype.type(1.0 / math.sqrt(q.shape[-1]))
    p = _inplace(xp.exp, s)
    p /= _sum_last(p)
    return p


def _attention_grads(q, k, v, p, g):
    """``ops.attention_grads`` with softmax's backward in dp's buffer."""
    xp = _xp(g)
    gv = xp.swapaxes(p, -1, -2) @ g
    gs = g @ xp.swapaxes(v, -1, -2)
    gs -= _vdot_last(gs, p)
    gs *= p
    gs *= q.dtype.type(1.0 / math.sqrt(q.shape[-1]))
    return gs @ k, xp.swapaxes(gs, -1, -2) @ q, gv


class ScaledDotProductAttention(ops.ScaledDotProductAttention):
    compilable = True

    @staticmethod
    def forward(ctx, q, k, v, causal=True):
        p = _attention_probs(q, k, causal)
        ctx.save(q, k, v, p)
        return p @ v

    @staticmethod
    def backward(ctx, g):
        q, k, v, p = ctx.saved
        return _attention_grads(q, k, v, p, g)


class PackedAttention(ops.PackedAttention):
    compilable = True

    @staticmethod
    def forward(ctx, qkv, n_head, causal=True):
        q, k, v = _heads(qkv, n_head)
        p = _attention_probs(q, k, causal)
        ctx.save(qkv, p)
        ctx.n_head = n_head
        return merge_heads(p @ v)

    @staticmethod
    def backward(ctx, g):
        qkv, p = ctx.saved
        return pack_heads(*_attention_grads(*_heads(qkv, ctx.n_head), p, split_heads(g, ctx.n_head)))


class CrossEntropy(ops.CrossEntropy):
    """``ops.CrossEntropy`` with e exponentiated in the shifted logits' buffer and s = Σ e by BLAS."""

    compilable = True

    @staticmethod
    def forward(ctx, logits, targets, ignore_index=-1):
        x, t, valid = ce_rows(logits, targets, ignore_index)
        e = x - x.max(axis=-1, keepdims=True)
        logit_t = _xp(x).take_along_axis(e, t[:, None], axis=-1)[:, 0]  # x_t - max x
        e = _inplace(_xp(x).exp, e)
        return ops.CrossEntropy.finish(ctx, logits, logit_t, e, _sum_last(e), t, valid)

    # the plain backward, as this class's own attribute: a profiler that wraps each class's methods
    # (benchmarks/train_step.py --profile) then times it once, not once per class in the chain
    backward = staticmethod(ops.CrossEntropy.backward)


FAST.update({ops.Gelu: Gelu, ops.Linear: Linear, ops.LayerNorm: LayerNorm,
             ops.ScaledDotProductAttention: ScaledDotProductAttention, ops.PackedAttention: PackedAttention,
             ops.CrossEntropy: CrossEntropy})
