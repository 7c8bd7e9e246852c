"""Bucketed shapes: how a KV cache keeps a compiling array library (JAX) from compiling every step.

On NumPy an array of a new shape costs nothing. On JAX every distinct shape is a new compiled
program (loaded from a cache or compiled; chapter 16 has what each costs), and KV-cached decoding reads one
more cached key per step: decoding T tokens would compile O(T) programs. The standard fix (the
usual TPU recipe; vLLM's CUDA graphs do the same) is to read the cache in *buckets*: the keys up to
the next power of two, the positions past the real length hidden by the causal mask, which already
hides every key after a query (exp(-inf) = 0, so they add exact zeros). Decoding T tokens then
compiles O(log T) programs. Where a write lands (slot, position) is an array argument of the
compiled write, not a constant in it, so one program serves every position.
"""

from __future__ import annotations

import numpy as np

from minidist.accel.backend import bucket, compiles_per_shape  # noqa: F401  (where inference finds them)


def array_where(rows, positions, take, n_rows: int) -> tuple:
    """A KV write's ``((rows, positions), take)`` (see ``kv_cache.valid_tokens``) with every varying
    part an index array -- an argument of the one compiled write, not a constant baked into a new
    program per position -- and no slices (``take``'s "every row" becomes ``arange(n_rows)``)."""
    def arr(i):
        return np.asarray(i, dtype=np.int64)

    take = tuple(np.arange(n_rows) if isinstance(i, slice) else i for i in take)
    return (arr(rows), arr(positions)), take
