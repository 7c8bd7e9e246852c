"""Differentiable primitives: each op's forward and backward side by side, and the Tensor-level API.

Every op is a ``Function`` subclass on raw backend arrays (``xp``: NumPy, CuPy or jax.numpy), its
backward the textbook formula, one file per kind: ``elementwise``, ``matmul``, ``shapes`` (sums,
reshapes, indexing, embedding), ``norms`` (softmax, LayerNorm, dropout), ``attention``, ``loss``;
``arrays`` holds their helpers. Pure array code, so the JAX engine can compile each one.

Here: the registry of fast forms (``FAST``: a plain op -> a faster one with the same contract, which
``minidist.autograd.fused`` registers when ``minidist`` is imported; ``fast(Op, x)`` picks it), the
lower-case functions on Tensors, and Tensor's operators and methods (``tensor.py`` imports no op).
"""

from __future__ import annotations

import contextlib
import os
import threading

import numpy as np

from minidist.accel.backend import backend_of

# -- the fast forms: which class runs an op -----------------------------------------------------
FAST: dict = {}  # plain op -> its fast form; minidist.autograd.fused fills it when minidist is imported
_ON = os.environ.get("MINIDIST_FUSED", "1") not in ("0", "false", "False", "")
_state = threading.local()


def fast(op, x):
    """The class that runs ``op`` (a plain Function) on ``x`` (its first input): its fast form from
    ``FAST`` on NumPy and CuPy, the plain op on JAX (it fuses the formula itself) or when off."""
    if not getattr(_state, "on", _ON):
        return op
    d = getattr(x, "data", x)
    if type(d) is np.ndarray or backend_of(d).inplace:
        return FAST.get(op, op)
    return op


def enabled() -> bool:
    """Do ops run their fast forms in this thread (``MINIDIST_FUSED``, ``disabled``)?"""
    return getattr(_state, "on", _ON)


@contextlib.contextmanager
def disabled():
    """Run the plain forms of the ops in this thread."""
    prev = enabled()
    _state.on = False
    try:
        yield
    finally:
        _state.on = prev


# -- the ops (one file per kind) ------------------------------------------------------------------
from minidist.autograd.ops.arrays import unbroadcast  # noqa: E402, F401
from minidist.autograd.ops.attention import (  # noqa: E402, F401
    PackedAttention,
    ScaledDotProductAttention,
    attention_grads,
    attention_probs,
    check_packed,
)
from minidist.autograd.ops.elementwise import (  # noqa: E402, F401
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
from minidist.autograd.ops.loss import CrossEntropy  # noqa: E402, F401
from minidist.autograd.ops.matmul import Linear, Matmul, low_precision  # noqa: E402, F401
from minidist.autograd.ops.norms import (  # noqa: E402, F401
    Dropout,
    LayerNorm,
    LogSoftmax,
    Softmax,
    dropout_mask,
    layer_norm_compute,
)
from minidist.autograd.ops.shapes import (  # noqa: E402, F401
    Concat,
    Embedding,
    GetItem,
    Max,
    Mean,
    Reshape,
    Sum,
    Transpose,
    _check_ids,
    split,
)
from minidist.autograd.tensor import Tensor  # noqa: E402


# -- the Tensor-level API --------------------------------------------------------------------------
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
    return fast(Gelu, a).apply(a)


def cast(a, dtype):
    return Cast.apply(a, dtype=dtype)


def matmul(a, b):
    return Matmul.apply(a, b)


def linear(x, w, b=None):
    """``x @ w + b``. With 2-byte float weights (bf16, fp16) as a tensor core does it: inputs cast up,
    accumulated in fp32, the output rounded once to ``w``'s dtype (gradients likewise)."""
    op = fast(Linear, x)
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


def embedding(weight, idx):
    idx = idx.data if isinstance(idx, Tensor) else idx
    _check_ids(idx, weight.shape[0], "embedding: token id array")
    return Embedding.apply(weight, idx)


def softmax(x, axis=-1):
    return Softmax.apply(x, axis=axis)


def log_softmax(x, axis=-1):
    return LogSoftmax.apply(x, axis=axis)


def layer_norm(x, w, b, eps=1e-5, compute=None):
    """LayerNorm over the last axis; ``compute`` (e.g. float32 under bf16 parameters): the dtype its
    statistics run in, the output rounded to ``w``'s dtype (see ``LayerNorm``)."""
    dt = None if compute is None else layer_norm_compute(compute, x, w, b)
    op = fast(LayerNorm, x)
    return op.apply(x, w, b, eps=eps) if dt is None else op.apply(x, w, b, eps=eps, compute=dt)


def dropout(x, p, rng, training=True):
    """Inverted dropout with a seeded NumPy generator ``rng``; identity when p == 0 or not training."""
    if not training or p == 0.0:
        return x
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    return Dropout.apply(x, p=p, rng=rng)


def scaled_dot_product_attention(q, k, v, causal=True):
    return fast(ScaledDotProductAttention, q).apply(q, k, v, causal=causal)


def packed_attention(qkv, n_head, causal=True):
    """Self-attention of fused projections qkv (B, T, 3·H·D) over ``n_head`` heads: (B, T, H·D)."""
    check_packed(qkv, n_head, "packed_attention")
    return fast(PackedAttention, qkv).apply(qkv, n_head=n_head, causal=causal)


def cross_entropy(logits, targets, ignore_index=-1):
    targets = targets.data if isinstance(targets, Tensor) else targets
    _check_ids(targets, logits.shape[-1], "cross_entropy: targets", ignore=ignore_index)
    return fast(CrossEntropy, logits).apply(logits, targets, ignore_index=ignore_index)


# -- Tensor's operators and methods, attached here where the ops live -----------------------------
Tensor.__add__, Tensor.__sub__, Tensor.__mul__, Tensor.__truediv__ = add, sub, mul, div
Tensor.__radd__ = lambda a, b: Add.apply(b, a)
Tensor.__rsub__ = lambda a, b: Sub.apply(b, a)
Tensor.__rmul__ = lambda a, b: Mul.apply(b, a)
Tensor.__rtruediv__ = lambda a, b: Div.apply(b, a)
Tensor.__pow__, Tensor.__rpow__ = pow, lambda a, b: Pow.apply(b, a)
Tensor.__matmul__, Tensor.__rmatmul__ = matmul, lambda a, b: Matmul.apply(b, a)
Tensor.__neg__, Tensor.__getitem__ = neg, getitem
Tensor.sum, Tensor.mean, Tensor.max = sum, mean, max
Tensor.exp, Tensor.log, Tensor.tanh, Tensor.relu, Tensor.astype = exp, log, tanh, relu, cast


def _shape_args(args):
    """``t.reshape(2, 3)`` and ``t.reshape((2, 3))`` alike."""
    return args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) else args


Tensor.reshape = lambda t, *shape: reshape(t, _shape_args(shape))
Tensor.transpose = Tensor.permute = lambda t, *axes: transpose(t, _shape_args(axes) or None)
