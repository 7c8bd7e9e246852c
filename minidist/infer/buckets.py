"""Bucketed shapes: how a KV cache keeps JAX from compiling a new program every decode step.

The cache is read up to the next power of two, the positions past the real ones hidden by the
causal mask, and where a write lands is an array argument of the compiled write: decoding T tokens
compiles O(log T) programs (chapter 16).
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
