"""A tensor-parallel shard described as slices of the full array: what a checkpoint records.

A checkpoint saves each rank's piece of a tensor and must reassemble it on any other mesh, without
knowing how tensor parallelism splits its layers. So the caller hands it, per sharded parameter,
the full array's shape and the ranges along one axis that this rank's part holds, side by side
(q|k|v's fused projection: three ranges). ``global_slices`` computes that from a sharding table.
"""

from __future__ import annotations

import numpy as np


def global_slices(named_params, table: dict, rank: int, size: int) -> dict:
    """{name: (full shape, axis, [(lo, hi), ...])} of the sharded parameters: the full array's shape
    and the ranges of ``axis`` that rank ``rank``'s part holds, side by side -- how a checkpoint
    records which piece of a tensor a rank saves (``TrainState(slices=...)``) without knowing ``Shard``.
    ``table``: a sharding table (``sharding.sharding_table``), ``{name: Shard or None}``."""
    out = {}
    for name, p in named_params:
        shard = table.get(name)
        if shard is None or size == 1:
            continue
        axis, full = shard.axis % len(p.shape), list(p.shape)
        full[axis] = sum(shard.widths) if shard.widths else full[axis] * size
        line = np.arange(full[axis]).reshape([-1 if i == axis else 1 for i in range(len(full))])
        held = shard.split(line, rank, size, name).reshape(-1)
        runs = np.split(held, np.flatnonzero(np.diff(held) != 1) + 1)
        out[name] = (tuple(full), axis, [(int(r[0]), int(r[-1]) + 1) for r in runs])
    return out
