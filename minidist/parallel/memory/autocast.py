"""The compute copy of mixed precision: low-precision parameters, fp32 accumulation.

``autocast(model, dtype)`` casts the model's parameters to bf16 or fp16 and wraps its layers: matmul
inputs stay low precision and accumulate in fp32 (what a tensor core does, emulated by casting up,
multiplying in fp32 and casting down), while LayerNorm statistics, the attention softmax and the
loss run in fp32. ``low_dtype`` names the dtypes; bf16 is ``ml_dtypes.bfloat16``, and
``round_to_bf16`` writes its round-to-nearest-even out by hand. Re-exported by
``minidist.parallel.memory.precision``.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from minidist.accel import compiled
from minidist.autograd import ops
from minidist.nn.layers import LayerNorm
from minidist.nn.module import Module

bfloat16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"bf16": bfloat16, "bfloat16": bfloat16, "fp16": np.dtype(np.float16),
          "float16": np.dtype(np.float16), "fp32": np.dtype(np.float32), "float32": np.dtype(np.float32)}


def low_dtype(name) -> np.dtype:
    """"bf16" | "fp16" | "fp32" (or a dtype) -> numpy dtype, with a clear error otherwise."""
    if isinstance(name, str):
        if name not in DTYPES:
            raise ValueError(f"unknown precision {name!r}; use one of bf16, fp16, fp32")
        return DTYPES[name]
    dt = np.dtype(name)
    if dt not in DTYPES.values():
        raise ValueError(f"unsupported compute dtype {dt}; use bfloat16, float16 or float32")
    return dt


def round_to_bf16(x) -> np.ndarray:
    """float32 -> bfloat16 by round-to-nearest-even on the bits (keep the top 16 of 32).

    Add 0x7FFF plus the lowest kept bit, then drop the low 16 bits: halfway cases round to the
    even neighbour; overflow carries into the exponent (to inf when it must). NaNs stay NaN.
    """
    x = np.array(x, dtype=np.float32, order="C")  # keeps 0-d shapes, unlike ascontiguousarray
    bits = x.view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))
    top = (rounded >> 16).astype(np.uint16)
    top = np.where(np.isnan(x), ((bits >> 16) | np.uint32(0x40)).astype(np.uint16), top)  # quiet NaN
    return top.view(bfloat16)


# ---------------------------------------------------------------------------------------------
# the compute copy: low-precision parameters, fp32 accumulation
# ---------------------------------------------------------------------------------------------
def _layer_norm_wrapper(ln, inner, x):
    """LayerNorm statistics in fp32, the output rounded to the low dtype: one op, which casts x, the
    weight and the bias up inside and its output down (``ops.layer_norm(..., compute=float32)``;
    gradients come back in each input's dtype). It computes the layer itself (autocast is the
    innermost wrapper, so nothing inside it is skipped)."""
    return ops.layer_norm(x, ln.weight, ln.bias, ln.eps, compute=np.promote_types(np.float32, x.dtype))


def _to_fp32(t):
    """``t`` as fp32 for what must run in fp32 (a softmax, the loss); already fp32: ``t`` itself."""
    return t if t.dtype == np.float32 else ops.cast(t, np.float32)


def _fp32_output_wrapper(module, inner, x):
    """The attention's qkv projection: low-precision values handed on in fp32, so the attention
    core (its softmax) runs in fp32, as torch.autocast does."""
    return _to_fp32(inner(x))


@compiled.pure  # on JAX one compiled call for the whole model, not one cast program per shape
def _cast_all(arrays, dtype) -> list:
    """Every array of ``arrays`` cast to ``dtype``: a new array each (on NumPy and CuPy a copy even
    when the dtype is already ``dtype``: the fp32 masters must not share memory with the model)."""
    return [a.astype(dtype) for a in arrays]


def autocast(model, dtype="bf16"):
    """Make ``model`` compute in ``dtype``; returns the model. Cast the logits to fp32 before the
    loss (``MixedPrecision.loss`` does).

    Its parameters are cast in place. Every product then runs in low precision with fp32
    accumulation by itself: ``ops.linear`` of 2-byte weights is a tensor core's product (so
    ``Linear`` and the tensor-parallel ``ColumnParallelLinear`` / ``RowParallelLinear`` need nothing,
    their communication moves low-precision values). Two ``"autocast"`` forward wrappers (the innermost
    position of ``Module``'s stack) do the rest: LayerNorm computes its statistics in fp32, and an
    attention's qkv projection hands its output on in fp32. ``remove_autocast`` takes them away."""
    dt = low_dtype(dtype)
    params = model.parameters()
    for p, low in zip(params, _cast_all([p.data for p in params], dt)):
        p.data = low
    owner = f"autocast ({dt.name})"
    for _, m in model.named_modules():
        if isinstance(m, LayerNorm):
            m.register_forward_wrapper(_layer_norm_wrapper, "autocast", owner)
        qkv = getattr(m, "qkv", None)  # an attention (serial or tensor-parallel)
        if isinstance(qkv, Module):
            qkv.register_forward_wrapper(_fp32_output_wrapper, "autocast", owner)
    return model  # (an Embedding needs nothing: rows of a low-precision table are low precision)


def remove_autocast(model):
    """Remove ``autocast``'s wrappers (the parameters keep their dtype: cast them back yourself)."""
    for _, m in model.named_modules():
        handle = m.forward_wrapper("autocast")
        if handle is not None:
            handle.remove()
    return model
