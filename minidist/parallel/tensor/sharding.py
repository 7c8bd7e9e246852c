"""How a model's parameters are sharded, as data: one ``Shard`` per parameter, declared by its layer.

A tensor-parallel layer says, for each of its parameters, how the full (serial) array is split
over the ranks of a group -- ``Shard(axis=1)``: equal contiguous blocks along axis 1, rank r keeps
block r -- or nothing (replicated: every rank holds the whole array). It declares this in its
``param_shards`` dict (``{"weight": Shard(1), "bias": Shard(0)}``); parameters not listed are
replicated. The attention's fused q|k|v projection is ``Shard(1, blocks=3)``: the axis holds
three matrices side by side, each split alike, so rank r keeps its heads of q, of k and of v.

``sharding_table(model)`` collects those declarations into one table, ``{name: Shard | None}``
under the names of ``model.named_parameters()``. Everything that converts between the full model
and its shards reads that table and nothing else (no rules on names):

    shard_state_dict(full_sd, table, rank, size)  # full arrays -> this rank's shards
    unshard(shards, table)                        # every rank's shards (rank order) -> full arrays
    reshard(shards, table, new_size)              # shards for ``size`` ranks -> for ``new_size``
    load_shard(module, full_sd, rank, size)       # a sharded module loads its part of a full one

The tensor-parallel GPT uses them for ``serial_state_dict`` / ``load_serial_state_dict``; sharded
inference to slice a trained model; a checkpoint to save shards and load them on another tp size.
Arrays are host NumPy arrays (``Backend.to_host`` first); a Shard's ``group`` names the mesh axis
whose ranks share the parameter ("tp"), so a table can hold shardings over several groups and the
functions convert one group at a time.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from minidist.accel.backend import to_host


@dataclass(frozen=True)
class Shard:
    """A parameter split in ``size`` equal parts along ``axis`` over the ranks of mesh axis ``group``.

    ``blocks > 1``: the axis is ``blocks`` equal blocks side by side (q|k|v: 3), each split into
    ``size`` parts; rank r keeps part r of every block, in block order.

    ``widths``: blocks of these widths instead (grouped-query attention's q|k|v: H·D, K·D, K·D), and
    ``whole``: the indices of blocks every rank keeps whole (K/V heads replicated over tp).
    """

    axis: int
    group: str = "tp"
    blocks: int = 1
    widths: tuple = ()
    whole: tuple = ()

    def _parts(self, n: int, size: int, what: str) -> list:
        """[(start, width, split?)] of each block of an axis of length ``n`` (``widths`` form)."""
        if sum(self.widths) != n:
            raise ValueError(f"{what}: blocks of widths {self.widths} don't add up to the axis length {n}")
        out, start = [], 0
        for i, w in enumerate(self.widths):
            split = i not in self.whole
            if split and w % size:
                raise ValueError(f"{what}: block {i} of width {w} ({self}) does not split into {size} "
                                 f"equal parts; the {self.group} size must divide {w}")
            out.append((start, w, split))
            start += w
        return out

    def _check(self, shape, size: int, what: str) -> int:
        axis = self.axis % len(shape)
        if shape[axis] % (self.blocks * size):
            each = f" of each of its {self.blocks} blocks" if self.blocks > 1 else ""
            raise ValueError(f"{what}: axis {axis} of shape {tuple(shape)} ({self}) does not split into "
                             f"{size} equal parts{each}; the {self.group} size must divide "
                             f"{shape[axis] // self.blocks}")
        return axis

    def split(self, full, rank: int, size: int, what: str = "parameter"):
        """Rank ``rank``'s part of the full array (a view where the array library allows)."""
        if self.widths:
            axis = self.axis % full.ndim
            pieces = []
            for start, w, split in self._parts(full.shape[axis], size, what):
                lo, n = (start + rank * (w // size), w // size) if split else (start, w)
                pieces.append(full[(slice(None),) * axis + (slice(lo, lo + n),)])
            return np.concatenate([np.asarray(p) for p in pieces], axis=axis)
        axis = self._check(full.shape, size, what)
        n = full.shape[axis] // self.blocks
        part = n // size
        lead, rest = full.shape[:axis], full.shape[axis + 1:]
        blocked = full.reshape(*lead, self.blocks, n, *rest)
        mine = blocked[(slice(None),) * (axis + 1) + (slice(rank * part, (rank + 1) * part),)]
        return mine.reshape(*lead, self.blocks * part, *rest)

    def concat(self, parts):
        """The full array from every rank's part (``parts[r]``: rank r's), the inverse of ``split``."""
        first = parts[0]
        axis = self.axis % first.ndim
        if self.widths:
            size, pieces, lo = len(parts), [], 0
            for _, w, split in self._parts(sum(self.widths), size, "concat"):
                n = w // size if split else w
                take = [np.asarray(p)[(slice(None),) * axis + (slice(lo, lo + n),)] for p in parts]
                pieces += take if split else take[:1]
                lo += n
            return np.concatenate(pieces, axis=axis)
        lead, local, rest = first.shape[:axis], first.shape[axis], first.shape[axis + 1:]
        blocked = [np.asarray(p).reshape(*lead, self.blocks, local // self.blocks, *rest) for p in parts]
        full = np.concatenate(blocked, axis=axis + 1)
        return full.reshape(*lead, self.blocks * full.shape[axis + 1], *rest)

    def local_shape(self, shape, size: int) -> tuple:
        if self.widths:
            axis = self.axis % len(shape)
            parts = self._parts(shape[axis], size, "local_shape")
            n = sum(w // size if split else w for _, w, split in parts)
            return tuple(shape[:axis]) + (n,) + tuple(shape[axis + 1:])
        axis = self._check(shape, size, "local_shape")
        return tuple(shape[:axis]) + (shape[axis] // size,) + tuple(shape[axis + 1:])


ROWS, COLUMNS = Shard(0), Shard(-1)


def split_rows(a, rank: int, size: int):
    """Rank ``rank``'s block of rows (axis 0) of ``a``, split into ``size`` equal blocks."""
    return ROWS.split(a, rank, size)


def split_columns(a, rank: int, size: int):
    """Rank ``rank``'s block of the last axis of ``a``, split into ``size`` equal blocks."""
    return COLUMNS.split(a, rank, size)


# -- the table of a model --------------------------------------------------------------------------

def sharding_table(model, prefix: str = "") -> OrderedDict:
    """``{parameter name: Shard or None (replicated)}`` for every parameter of ``model``, in
    ``named_parameters`` order, read from each module's ``param_shards`` declaration.
    ``prefix`` is put before every name (e.g. ``"3."``: a pipeline stage's layer 3)."""
    declared = {}
    for mprefix, mod in model.named_modules(prefix):
        for pname, shard in getattr(mod, "param_shards", {}).items():
            if pname not in mod._params:
                raise ValueError(f"{type(mod).__name__} declares a sharding for {pname!r}, which is not one "
                                 f"of its parameters {list(mod._params)}")
            declared[mprefix + pname] = shard
    return OrderedDict((name, declared.get(name)) for name, _ in model.named_parameters(prefix))


def _host(a) -> np.ndarray:
    return to_host(a) if hasattr(a, "shape") else np.asarray(a)


def _shard_of(table, name: str, group: str):
    if name not in table:
        raise KeyError(f"{name!r} is not in the sharding table (which has {list(table)[:4]}...): "
                       f"build the table from the same model as the state_dict")
    shard = table[name]
    return shard if shard is not None and shard.group == group else None


def shard_state_dict(full_sd: dict, table: dict, rank: int, size: int, group: str = "tp") -> OrderedDict:
    """Rank ``rank``'s (of ``size`` in ``group``) part of every array of a full state_dict."""
    out = OrderedDict()
    for name, a in full_sd.items():
        host, shard = _host(a), _shard_of(table, name, group)
        out[name] = host if shard is None else np.ascontiguousarray(shard.split(host, rank, size, name))
    return out


def unshard(shards: list, table: dict, group: str = "tp") -> OrderedDict:
    """The full state_dict from every rank's state_dict of ``group`` (``shards[r]``: rank r's)."""
    out = OrderedDict()
    for name in shards[0]:
        parts = [_host(s[name]) for s in shards]
        shard = _shard_of(table, name, group)
        out[name] = parts[0] if shard is None else shard.concat(parts)
    return out


def load_shard(module, full_sd: dict, rank: int, size: int, group: str = "tp"):
    """Load into the sharded ``module`` its part (rank ``rank`` of ``size``) of the full state_dict
    ``full_sd`` (e.g. its serial twin's), by the module's own sharding table. Returns the module."""
    return module.load_state_dict(shard_state_dict(full_sd, sharding_table(module), rank, size, group))


def reshard(shards: list, table: dict, new_size: int, group: str = "tp") -> list:
    """State_dicts sharded over ``len(shards)`` ranks of ``group`` -> over ``new_size`` ranks."""
    full = unshard(shards, table, group)
    return [shard_state_dict(full, table, r, new_size, group) for r in range(new_size)]


# -- grouped-query attention's K/V heads over tp ------------------------------------------------------

def kv_heads_split(n_head: int, n_kv_head: int, tp: int) -> bool:
    """The rule for K/V heads under tensor parallelism: split (rank r keeps K/V heads
    r·K/tp .. (r+1)·K/tp - 1, the groups of its query heads) when tp divides n_kv_head; otherwise
    replicated (every rank holds all K heads, e.g. multi-query attention at any tp > 1). The
    query heads are always split, so tp must divide n_head."""
    if n_head % tp:
        ok = [d for d in range(1, n_head + 1) if n_head % d == 0]
        raise ValueError(f"n_head = {n_head} is not divisible by the tensor-parallel size {tp}: the query "
                         f"heads are split across tp; use a tp size in {ok}")
    return n_kv_head % tp == 0


def local_kv_heads(n_head: int, n_kv_head: int, tp: int) -> int:
    """How many K/V heads each of ``tp`` ranks holds (and caches): K/tp split, K replicated."""
    return n_kv_head // tp if kv_heads_split(n_head, n_kv_head, tp) else n_kv_head


def kv_of_local_heads(n_head: int, n_kv_head: int, tp: int, rank: int):
    """The K/V head (among this rank's) of each of this rank's n_head/tp query heads: None when they
    are whole groups in order (split, or tp = 1: local head j uses j // (H/K)); otherwise the
    tuple of global K/V heads h // (H/K) for the rank's query heads h (replicated K/V)."""
    if kv_heads_split(n_head, n_kv_head, tp):
        return None
    local, group = n_head // tp, n_head // n_kv_head
    return tuple((rank * local + j) // group for j in range(local))
