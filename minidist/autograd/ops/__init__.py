"""Differentiable primitives: each op's forward and backward side by side, and the Tensor-level API.

Every op is a ``Function`` subclass working on raw backend arrays (``xp`` is NumPy, CuPy or
jax.numpy, found from the arrays themselves), plus a lower-case wrapper here that takes Tensors.
Backward formulas are written out, not derived by a tracer, so a reader can check each one
against the textbook: every op is that formula in plain ``xp`` code, nothing else. The classes
live by kind, one file each:

* ``elementwise``: add, sub, mul, div, neg, pow, exp, log, tanh, relu, gelu, cast;
* ``matmul``: ``Matmul`` and ``Linear``;
* ``shapes``: sum, mean, max, reshape, transpose, indexing, concat, embedding;
* ``norms``: softmax, log-softmax, LayerNorm, dropout;
* ``attention``: scaled dot-product attention, on q, k, v or on packed qkv;
* ``loss``: cross-entropy;
* ``arrays``: the helpers they share (the array namespace, unbroadcasting, rows of a matrix).

Every Function defined in this package is pure array code -- no communication, no host state --
which is what lets the JAX engine compile each one (``minidist.accel.compiled.kernel``).

The ops a model spends its time in (``linear``, ``gelu``, ``layer_norm``, the two attentions,
``cross_entropy``) are fused -- one op, saving only what their backward needs -- and have a second,
fast form in ``minidist.autograd.fused`` (in-place chains, BLAS sums) with the same contract. Their
lower-case wrappers run the class ``fused.fast(Op, x)`` picks: the fast form on NumPy and CuPy, the
plain one on JAX or under ``MINIDIST_FUSED=0`` / ``fused.disabled()``.
"""

from __future__ import annotations

import builtins

import numpy as np

from minidist.autograd.ops.arrays import _back_to, _rows, _shape, _xp, unbroadcast  # noqa: F401
from minidist.autograd.ops.attention import (  # noqa: F401
    PackedAttention,
    ScaledDotProductAttention,
    _heads,
    attention_grads,
    attention_probs,
    causal_hidden,
    check_packed,
    merge_heads,
    pack_heads,
    split_heads,
)
from minidist.autograd.ops.elementwise import (  # noqa: F401
    GELU_C,
    GELU_K,
    Add,
    Cast,
    Div,
    Exp,
    Gelu,
    Log,
    Mul,
    Neg,
    Pow,
    Relu,
    Sub,
    Tanh,
)
from minidist.autograd.ops.loss import CrossEntropy, ce_rows  # noqa: F401
from minidist.autograd.ops.matmul import Linear, Matmul, _check_matmul, low_precision  # noqa: F401
from minidist.autograd.ops.norms import Dropout, LayerNorm, LogSoftmax, Softmax, _softmax, dropout_mask  # noqa: F401
from minidist.autograd.ops.shapes import (  # noqa: F401
    Concat,
    Embedding,
    GetItem,
    Max,
    Mean,
    Reshape,
    Sum,
    Transpose,
    _check_ids,
)
from minidist.autograd.tensor import Tensor


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


def cross_entropy(logits, targets, ignore_index=-1):
    targets = _data(targets)
    _check_ids(targets, logits.shape[-1], "cross_entropy: targets", ignore=ignore_index)
    return fused.fast(CrossEntropy, logits).apply(logits, targets, ignore_index=ignore_index)


from minidist.autograd import fused  # noqa: E402 - the fast forms subclass the ops above
