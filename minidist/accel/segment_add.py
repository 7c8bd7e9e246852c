"""Deterministic scatter-add on a GPU: each target element adds its contributions in index order.

``cupyx.scatter_add`` adds with atomics, so the contributions to one element land in whatever order
the GPU's threads finish, and a float sum differs in its last bits from run to run. An embedding's
gradient is such a sum (a token that occurs twice adds two rows), so on CuPy two identical runs
would differ in the last bits: a restart would not be bit-identical to a run that never failed, and
offload's "exactly the same parameters" check would fail (chapter 16 has the measurement). The
remedy is PyTorch's deterministic mode's: sort the positions (a stable sort keeps equal positions in
index order), cut the sorted list into segments of equal positions, and let one thread add each
segment's values in that order -- the order NumPy's ``add.at`` uses, so CuPy's bits equal NumPy's.

``flat_positions`` and ``segments`` are plain array code (tested on NumPy); ``cupy_scatter_add``
adds the CuPy kernel that walks each segment.
"""

from __future__ import annotations

import math

import numpy as np


def flat_positions(xp, shape, index):
    """Where each element of ``target[index]`` sits in ``target.reshape(-1)`` (int64, shaped like
    ``target[index]``), for any NumPy index: integers, arrays, slices, tuples of them."""
    index = _on_device(xp, index)
    ids = index if isinstance(index, tuple) else (index,)
    if ids and len(ids) <= len(shape) and all(map(_is_integer, ids)):
        # integer ids over the leading axes -- an embedding's flat ids, cross-entropy's (arange, t),
        # MoE's rows -- and whole rows after them: no table the size of the target
        lead, rest = _ravel(xp, shape[:len(ids)], ids), shape[len(ids):]
        if not rest:
            return lead
        row = math.prod(rest)
        return (lead[..., None] * row + xp.arange(row, dtype=np.int64)).reshape(lead.shape + rest)
    return xp.arange(math.prod(shape), dtype=np.int64).reshape(shape)[index]  # slices, mixed indexes


def _is_integer(i) -> bool:
    """An integer index for one axis: an int or an array of integers (not a bool mask)."""
    return isinstance(i, (int, np.integer)) and not isinstance(i, bool) or (
        hasattr(i, "dtype") and i.dtype.kind in "iu")


def _ravel(xp, shape, index):
    """``np.ravel_multi_index`` with NumPy indexing's rules: negative ids wrap, the per-axis ids
    broadcast, and an id outside ``[-size, size)`` raises IndexError as ``np.add.at`` does."""
    ids = [xp.asarray(i, dtype=np.int64) for i in index]
    outside = [((i < -n) | (i >= n)).any() for i, n in zip(ids, shape)]
    if bool(xp.stack(outside).any()):  # one read-back on a GPU, then find the axis
        for axis, (i, n) in enumerate(zip(ids, shape)):
            bad = i[(i < -n) | (i >= n)]
            if bad.size:
                raise IndexError(f"scatter_add: index {int(bad.reshape(-1)[0])} is out of bounds for axis "
                                 f"{axis} with size {n} (ids must lie in [{-n}, {n}))")
    lin = xp.zeros((), dtype=np.int64)
    for i, n in zip(ids, shape):
        lin = lin * n + xp.where(i < 0, i + n, i)
    return lin


def _on_device(xp, index):
    """The index with its host (NumPy) arrays moved to ``xp``'s device: CuPy indexes with its own."""
    if isinstance(index, tuple):
        return tuple(_on_device(xp, i) for i in index)
    return xp.asarray(index) if isinstance(index, np.ndarray) and xp is not np else index


def segments(xp, lin):
    """(order, starts, stops) for flat positions ``lin`` (1-D): ``order`` sorts them stably, and
    segment s, ``order[starts[s]:stops[s]]``, lists the contributions to one position in index order."""
    order = xp.argsort(lin, kind="stable") if xp is np else xp.argsort(lin)  # CuPy's sort is stable
    ordered = lin[order]
    new = xp.concatenate([xp.ones(min(1, lin.size), dtype=bool), ordered[1:] != ordered[:-1]])
    starts = xp.flatnonzero(new).astype(np.int64)
    stops = xp.concatenate([starts[1:], xp.asarray([lin.size], dtype=np.int64)])
    return order.astype(np.int64), starts, stops


_KERNEL = None


def _kernel():
    """One thread per segment: target[p] = (((target[p] + v0) + v1) + ...), in index order."""
    global _KERNEL
    if _KERNEL is None:
        import cupy

        _KERNEL = cupy.ElementwiseKernel(
            "int64 start, int64 stop, raw int64 order, raw int64 lin, raw T values",
            "raw T target",
            """
            const long long at = lin[order[start]];
            T acc = target[at];
            for (long long j = start; j < stop; ++j) acc = acc + values[order[j]];
            target[at] = acc;
            """,
            "minidist_segment_add")
    return _KERNEL


def cupy_scatter_add(target, index, values):
    """``np.add.at(target, index, values)`` on CuPy, in place, with NumPy's order of additions."""
    import cupy

    if not target.flags.c_contiguous:
        raise ValueError(f"scatter_add: the target must be C-contiguous, got strides {target.strides}")
    lin = flat_positions(cupy, target.shape, index)
    vals = cupy.ascontiguousarray(cupy.broadcast_to(cupy.asarray(values, dtype=target.dtype), lin.shape))
    lin, vals = lin.reshape(-1), vals.reshape(-1)
    if lin.size == 0:
        return target
    order, starts, stops = segments(cupy, lin)
    _kernel()(starts, stops, order, lin, vals, target.reshape(-1))
    return target
