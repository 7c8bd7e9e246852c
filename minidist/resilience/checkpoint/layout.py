"""Which piece of which global tensor a rank holds, and how to rebuild any piece from others.

Every array of the training state is a *slot*: a local array that is one piece of a global tensor
(``model/3.attn.qkv.weight``, ``optim/m/3.attn.qkv.weight``). A piece is described as data, by what
the caller hands over -- the global shape and which slice of it the piece is:

* ``axis, ranges`` -- the piece is the global tensor's ranges ``[lo, hi)`` along ``axis``, side by
  side in that order (a tensor-parallel shard; q|k|v: three ranges); None: the whole tensor;
* ``flat = [lo, hi)`` -- optionally, only elements lo..hi-1 of that, flattened (ZeRO keeps a flat
  slice of a bucket; its overlap with one parameter is such a range).

``global_indices`` turns a description into the C-order flat indices of the global tensor that the
piece holds, in the piece's own order. Any two layouts can then be matched by intersecting index
sets, which is all resharding is (``assemble``): a rank reads only the pieces that overlap what it
needs, and copies the common elements.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from minidist.accel.backend import to_host
from minidist.resilience.checkpoint.errors import CheckpointError


def _along(a, axis, ranges):
    """The ranges of ``a`` along ``axis``, side by side (the whole of ``a`` when ``ranges`` is None)."""
    if ranges is None:
        return a
    lead = (slice(None),) * axis
    return np.concatenate([a[lead + (slice(lo, hi),)] for lo, hi in ranges], axis=axis)


def global_indices(shape, axis=None, ranges=None, flat=None) -> np.ndarray:
    """Flat (C-order) indices into the global tensor of ``shape`` of the piece's elements, in order."""
    idx = np.arange(int(np.prod(shape, dtype=np.int64)), dtype=np.int64).reshape(shape)
    local = _along(idx, None if axis is None else axis % idx.ndim, ranges).reshape(-1)
    return local[flat[0]:flat[1]] if flat is not None else local


def local_shape(shape, axis=None, ranges=None, flat=None) -> tuple:
    if flat is not None:
        return (flat[1] - flat[0],)
    if ranges is None:
        return tuple(shape)
    axis %= len(shape)
    return tuple(shape[:axis]) + (sum(hi - lo for lo, hi in ranges),) + tuple(shape[axis + 1:])


@dataclass
class Slot:
    """One local array of the training state: how to read it, write it, and where it sits globally."""

    name: str
    shape: tuple            # the global tensor's shape
    dtype: np.dtype
    get: Callable[[], np.ndarray]
    set: Callable[[np.ndarray], None]
    axis: int | None = None      # the piece is ``ranges`` of the global tensor along ``axis``
    ranges: list | None = None   # [(lo, hi), ...]; None: the whole tensor (replicated)
    flat: tuple | None = None
    extra: dict = field(default_factory=dict)

    def spec(self) -> dict:
        ranges = [list(r) for r in self.ranges] if self.ranges is not None else None
        flat = list(self.flat) if self.flat is not None else None
        return {"axis": self.axis, "ranges": ranges, "flat": flat}

    def key(self) -> tuple:
        ranges = tuple(map(tuple, self.ranges)) if self.ranges is not None else None
        return (self.name, self.axis, ranges, self.flat)

    def local_shape(self) -> tuple:
        return local_shape(self.shape, self.axis, self.ranges, self.flat)


def _same_spec(piece: dict, slot: Slot) -> bool:
    return (piece["axis"], piece["ranges"], piece["flat"]) == tuple(slot.spec().values())


def assemble(slot: Slot, tensor: dict, read) -> np.ndarray:
    """The slot's array from the checkpoint's pieces of its tensor (``tensor``: the manifest entry);
    ``read(piece)`` reads one piece. Checks the global shape and dtype first."""
    if list(tensor["shape"]) != list(slot.shape):
        raise CheckpointError(f"{slot.name}: the checkpoint has global shape {tuple(tensor['shape'])}, this "
                              f"model expects {tuple(slot.shape)}; build the model with the config it was "
                              "saved with")
    if np.dtype(tensor["dtype"]) != np.dtype(slot.dtype):
        raise CheckpointError(f"{slot.name}: the checkpoint holds {np.dtype(tensor['dtype'])}, this model "
                              f"has {np.dtype(slot.dtype)}; build the model with dtype={tensor['dtype']!r} "
                              "(or convert the checkpoint explicitly)")
    want_shape = slot.local_shape()
    for piece in tensor["pieces"]:  # the common case: the same layout as when it was saved
        if _same_spec(piece, slot):
            return read(piece).reshape(want_shape)
    want = global_indices(slot.shape, slot.axis, slot.ranges, slot.flat)
    out = np.empty(want.size, np.dtype(slot.dtype))
    covered = np.zeros(want.size, bool)
    lo, hi = (int(want.min()), int(want.max())) if want.size else (0, -1)
    for piece in tensor["pieces"]:
        src = global_indices(slot.shape, piece["axis"], piece["ranges"], piece["flat"])
        if not src.size or src.max() < lo or src.min() > hi:
            continue  # cannot overlap: not read at all
        _, i_want, i_src = np.intersect1d(want, src, assume_unique=True, return_indices=True)
        if i_want.size:
            out[i_want] = read(piece).reshape(-1)[i_src]
            covered[i_want] = True
    if not covered.all():
        raise CheckpointError(f"{slot.name}: the checkpoint's pieces cover only {int(covered.sum())} of the "
                              f"{want.size} elements this rank needs (a rank's file is missing from it)")
    return out.reshape(want_shape)


# -- the slots of a model, an optimizer, a ZeRO wrapper -----------------------------------------------

def _param_setter(p, what: str):
    def set_(a):
        a = np.asarray(a)
        if a.shape != tuple(p.shape):
            raise CheckpointError(f"{what}: got a piece of shape {a.shape}, the parameter is "
                                  f"{tuple(p.shape)}")
        p.data = p.backend.from_host(np.array(a, dtype=p.dtype))
    return set_


def param_slots(named_params, slices: dict) -> list[Slot]:
    """``model/<name>`` slots of (name, parameter) pairs; ``slices[name]``: (global shape, axis, ranges)
    of a parameter that is a piece of a larger tensor (absent: the parameter is the whole tensor)."""
    slots = []
    for name, p in named_params:
        shape, axis, ranges = slices.get(name, (tuple(p.shape), None, None))
        if ranges is not None:
            axis, ranges = int(axis) % len(shape), [(int(lo), int(hi)) for lo, hi in ranges]
        slots.append(Slot(f"model/{name}", tuple(map(int, shape)), np.dtype(p.dtype),
                          (lambda p=p: to_host(p.data)), _param_setter(p, f"model/{name}"), axis, ranges))
    return slots


def optimizer_slots(opt, param_slots_by_id: dict, keys) -> list[Slot]:
    """``optim/<key>/<name>`` slots of a plain optimizer's per-parameter state (AdamW's m and v, SGD's
    momentum), laid out like their parameters. ``keys``: the state keys to include (at load time the
    optimizer has no state yet: the keys come from the checkpoint)."""
    slots = []
    for i, p in enumerate(opt.params):
        ps = param_slots_by_id.get(id(p))
        if ps is None:
            continue
        for key in keys:
            def get(i=i, key=key):
                return to_host(opt.state[i][key])

            def set_(a, i=i, key=key, p=p):
                opt.state[i][key] = p.backend.from_host(np.array(a, dtype=p.dtype).reshape(p.shape))

            pname = ps.name.split("/", 1)[1]
            slots.append(Slot(f"optim/{key}/{pname}", ps.shape, ps.dtype, get, set_, ps.axis, ps.ranges,
                              extra={"index": i, "key": key}))
    return slots


def zero_slots(zero, keys, names: dict) -> tuple[list[Slot], list[Callable]]:
    """Slots of a ZeRO rank's owned slices: for each bucket, its overlap with each parameter is a flat
    range of that parameter. Returns (slots, finishers): loading fills host buffers, and the finishers
    (run after every slot was set) hand the buffers back to the shards and the optimizer."""
    comm, opt = zero.comm, zero.optimizer
    slots, finishers = [], []
    for bi, (b, shard) in enumerate(zip(zero.buckets, zero.shards)):
        lo, hi = b.shard(comm.rank, comm.size)
        bufs = {None: to_host(shard.data).copy()}
        for key in keys:
            st = opt.state[bi]
            bufs[key] = to_host(st[key]).copy() if key in st else np.zeros(hi - lo, b.dtype)
        for p, o, n in zip(b.params, b.offsets, b.sizes):
            a, c = max(lo, o), min(hi, o + n)
            if a >= c:
                continue
            pname = names[id(p)]
            for key in [None, *keys]:
                name = f"model/{pname}" if key is None else f"optim/{key}/{pname}"

                def get(buf=bufs[key], i=a - lo, j=c - lo):
                    return buf[i:j]

                def set_(x, buf=bufs[key], i=a - lo, j=c - lo):
                    buf[i:j] = np.asarray(x).reshape(-1)

                slots.append(Slot(name, tuple(p.shape), np.dtype(b.dtype), get, set_, flat=(a - o, c - o),
                                  extra={"key": key, "bucket": bi}))

        def finish(bi=bi, bufs=bufs, shard=shard):
            shard.data = shard.backend.from_host(bufs[None])
            for key in keys:
                opt.state[bi][key] = shard.backend.from_host(bufs[key])
        finishers.append(finish)
    return slots, finishers
