"""fp16 / bf16 compression: send the gradient in a 2-byte float, half of fp32's bytes.

Each rank multiplies by 1/p *before* the sum (a loss-scaled fp16 gradient summed over p ranks would
overflow p times sooner), sums in the low dtype, and the hook casts the sum back up (times p: DDP
divides by the batch itself). Mixed precision's ``all_reduce_grads`` does the same arithmetic on
gradients that are already bf16/fp16.
"""

from __future__ import annotations

from minidist.accel import compiled
from minidist.comm import all_reduce
from minidist.parallel.memory.autocast import low_dtype


def cast_all_reduce(comm, flat, dtype, algorithm: str = "auto"):
    """Σ_r flat_r / p, sent and summed in ``dtype``; returned in ``dtype``."""
    return all_reduce(comm, _cast_scaled(flat, dtype, 1.0 / comm.size), op="sum", algorithm=algorithm)


@compiled.pure  # on JAX one compiled call per step, not an eager cast and multiply
def _cast_scaled(flat, dtype, factor):
    low = flat.astype(dtype, copy=False)
    return low * low.dtype.type(factor)


class CastState:
    """Which 2-byte float the gradients travel in: "bf16" or "fp16"."""

    def __init__(self, dtype="bf16"):
        self.dtype = low_dtype(dtype)


def cast_hook(state: CastState, bucket):
    """fp16/bf16 hook: cast down, all-reduce (pre-divided by p), cast back up, times p (a sum)."""
    def work(c, x):
        return cast_all_reduce(c, x, state.dtype, bucket.algorithm).astype(x.dtype) * x.dtype.type(c.size)
    return bucket.start(work, bucket.flat, f"{state.dtype.name} all-reduce b{bucket.index}")
