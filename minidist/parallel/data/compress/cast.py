"""fp16 / bf16 compression: send the gradient in a 2-byte float, half of fp32's bytes.

Each rank multiplies by 1/p *before* the sum (a loss-scaled fp16 gradient summed over p ranks would
overflow p times sooner), sums in the low dtype, and the hook casts the sum back up (times p: DDP
divides by the batch itself). Mixed precision's ``all_reduce_grads`` calls ``cast_all_reduce`` on
gradients that are already bf16/fp16: the bytes are the same as before it moved here.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from minidist.accel import compiled
from minidist.comm import all_reduce


def cast_all_reduce(comm, flat, dtype, algorithm: str = "auto"):
    """Σ_r flat_r / p, sent and summed in ``dtype``; returned in ``dtype``."""
    return all_reduce(comm, _cast_scaled(flat, dtype, 1.0 / comm.size), op="sum", algorithm=algorithm)


@compiled.pure  # on JAX one compiled call per step, not an eager cast and multiply
def _cast_scaled(flat, dtype, factor):
    low = flat.astype(dtype, copy=False)
    return low * low.dtype.type(factor)


DTYPES = {"bf16": np.dtype(ml_dtypes.bfloat16), "bfloat16": np.dtype(ml_dtypes.bfloat16),
          "fp16": np.dtype(np.float16), "float16": np.dtype(np.float16)}


class CastState:
    """Which 2-byte float the gradients travel in: "bf16" or "fp16" (or that dtype)."""

    def __init__(self, dtype="bf16"):
        dt = DTYPES.get(dtype) if isinstance(dtype, str) else np.dtype(dtype)
        if dt not in DTYPES.values():
            raise ValueError(f"cast compression sends bf16 or fp16, not {dtype!r}")
        self.dtype = dt


def cast_hook(state: CastState, bucket):
    """fp16/bf16 hook: cast down, all-reduce (pre-divided by p), cast back up, times p (a sum)."""
    def work(c, x):
        return cast_all_reduce(c, x, state.dtype, bucket.algorithm).astype(x.dtype) * x.dtype.type(c.size)
    return bucket.start(work, bucket.flat, f"{state.dtype.name} all-reduce b{bucket.index}")
