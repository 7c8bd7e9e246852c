"""What a tensor-parallel rank owns, as data: one ``Shard`` per parameter, declared by its layer.

``Shard(axis=1)``: the full (serial) array split in equal contiguous blocks along axis 1 over the
ranks of a group, rank r keeping block r; no Shard: replicated. A layer declares its parameters'
in ``param_shards`` (``{"weight": Shard(1), "bias": Shard(0)}``). The fused q|k|v projection is
``Shard(1, blocks=3)``: three matrices side by side, each split alike (rank r keeps its heads of
each). Arrays are host NumPy arrays. ``sharding.py`` converts whole state_dicts with these.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Shard:
    """A parameter split in ``size`` equal parts along ``axis`` over the ranks of mesh axis ``group``.

    ``blocks > 1``: the axis is ``blocks`` equal blocks side by side (q|k|v: 3), each split into
    ``size`` parts; rank r keeps part r of every block, in block order. ``widths``: blocks of these
    widths instead (grouped-query q|k|v: H·D, K·D, K·D); ``whole``: the blocks every rank keeps whole.
    """

    axis: int
    group: str = "tp"
    blocks: int = 1
    widths: tuple = ()
    whole: tuple = ()

    def _parts(self, shape, size: int, what: str):
        """(axis, [(start, width, split?)] of the blocks along it) for an array of ``shape``."""
        axis = self.axis % len(shape)
        if not self.widths:
            if shape[axis] % (self.blocks * size):
                each = f" of each of its {self.blocks} blocks" if self.blocks > 1 else ""
                raise ValueError(f"{what}: axis {axis} of shape {tuple(shape)} ({self}) does not split into "
                                 f"{size} equal parts{each}; the {self.group} size must divide "
                                 f"{shape[axis] // self.blocks}")
            w = shape[axis] // self.blocks
            return axis, [(i * w, w, True) for i in range(self.blocks)]
        if sum(self.widths) != shape[axis]:
            raise ValueError(f"{what}: blocks of widths {self.widths} don't add up to the axis length "
                             f"{shape[axis]}")
        out, start = [], 0
        for i, w in enumerate(self.widths):
            if i not in self.whole and w % size:
                raise ValueError(f"{what}: block {i} of width {w} ({self}) does not split into {size} "
                                 f"equal parts; the {self.group} size must divide {w}")
            out.append((start, w, i not in self.whole))
            start += w
        return axis, out

    def split(self, full, rank: int, size: int, what: str = "parameter"):
        """Rank ``rank``'s part of the full array (a view when it is one block)."""
        axis, parts = self._parts(full.shape, size, what)
        pieces = []
        for start, w, split in parts:
            lo, n = (start + rank * (w // size), w // size) if split else (start, w)
            pieces.append(full[(slice(None),) * axis + (slice(lo, lo + n),)])
        return pieces[0] if len(pieces) == 1 else np.concatenate([np.asarray(p) for p in pieces], axis=axis)

    def concat(self, parts):
        """The full array from every rank's part (``parts[r]``: rank r's), the inverse of ``split``."""
        parts = [np.asarray(p) for p in parts]
        axis, size = self.axis % parts[0].ndim, len(parts)
        shape = list(parts[0].shape)
        shape[axis] = sum(self.widths) if self.widths else shape[axis] * size
        pieces, lo = [], 0
        for _, w, split in self._parts(shape, size, "concat")[1]:
            n = w // size if split else w
            take = [p[(slice(None),) * axis + (slice(lo, lo + n),)] for p in parts]
            pieces += take if split else take[:1]
            lo += n
        return np.concatenate(pieces, axis=axis)

    def local_shape(self, shape, size: int) -> tuple:
        axis, parts = self._parts(shape, size, "local_shape")
        n = sum(w // size if split else w for _, w, split in parts)
        return tuple(shape[:axis]) + (n,) + tuple(shape[axis + 1:])


ROWS, COLUMNS = Shard(0), Shard(-1)


def split_rows(a, rank: int, size: int):
    """Rank ``rank``'s block of rows (axis 0) of ``a``, split into ``size`` equal blocks."""
    return ROWS.split(a, rank, size)


def split_columns(a, rank: int, size: int):
    """Rank ``rank``'s block of the last axis of ``a``, split into ``size`` equal blocks."""
    return COLUMNS.split(a, rank, size)


# -- grouped-query attention's K/V heads over tp ------------------------------------------------------

def kv_heads_split(n_head: int, n_kv_head: int, tp: int) -> bool:
    """K/V heads under tensor parallelism: split (rank r keeps the K/tp heads of its query heads'
    groups) when tp divides n_kv_head, else replicated (e.g. multi-query attention). The query heads
    are always split: tp must divide n_head."""
    if n_head % tp:
        ok = [d for d in range(1, n_head + 1) if n_head % d == 0]
        raise ValueError(f"n_head = {n_head} is not divisible by the tensor-parallel size {tp}: the query "
                         f"heads are split across tp; use a tp size in {ok}")
    return n_kv_head % tp == 0


def local_kv_heads(n_head: int, n_kv_head: int, tp: int) -> int:
    """How many K/V heads each of ``tp`` ranks holds (and caches): K/tp split, K replicated."""
    return n_kv_head // tp if kv_heads_split(n_head, n_kv_head, tp) else n_kv_head


def kv_of_local_heads(n_head: int, n_kv_head: int, tp: int, rank: int):
    """The K/V head of each of this rank's query heads: None when they are whole groups in order
    (split, or tp = 1); otherwise (replicated K/V) the global K/V heads h // (H/K) of its heads h."""
    if kv_heads_split(n_head, n_kv_head, tp):
        return None
    local, group = n_head // tp, n_head // n_kv_head
    return tuple((rank * local + j) // group for j in range(local))
