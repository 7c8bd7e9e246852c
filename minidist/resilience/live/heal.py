"""Healing: a replacement takes a live peer's state over the transport, not from disk.

The donor is the rank at the same position (tensor/pipeline rank) in a participating replica group, so
its arrays have exactly the replacement's layout: no resharding, each array moves once. What moves is
the ``TrainState`` each side is handed, copied by the donor at the start of the step (``pack_state``:
its own step goes on while a thread sends), in this order:

1. a header (one small pickled object): every array's name, shape and dtype, the optimizer's state
   keys, and the donor's *small state as it was at the start of the step* -- optimizer scalars,
   every object's ``state_dict`` (data position, step count) and every RNG stream;
2. the arrays -- parameters, then optimizer state (AdamW's m and v), then what objects hand over
   themselves (``arrays()``: LocalSGD's anchors) -- one flat message per dtype;
3. the receiver checks names and shapes, sets every array, then loads the small state.

Sent from the start-of-step small state (the donor has since drawn this step's batch and seed), so
the replacement runs the step's bookkeeping itself and ends the step equal to the donor, bit for bit.
"""

from __future__ import annotations

import numpy as np

from minidist.resilience.live.errors import HealFailed

HEAL_TAG = 7


def _keys(state) -> list[str]:
    opt = state._optimizer
    return sorted({k for st in opt.state for k in st}) if opt is not None else []


def _extra(state) -> list:
    """(name, object, key) of the arrays that ``TrainState`` objects hand over themselves (``arrays()``
    / ``load_arrays()``: LocalSGD's anchors and outer momentum), in a fixed order."""
    return [(n, o, k) for n, o in sorted(state.objects.items()) if hasattr(o, "arrays") for k in o.arrays()]


def pack_state(state, small: dict) -> tuple[dict, list]:
    """(header, flat arrays) of this rank's ``state`` -- copies, taken now -- with ``small``, its
    ``small_state()`` at the start of the step. What ``send_packed`` sends."""
    keys = _keys(state)
    slots, _ = state.slots(optim_keys=keys)
    names = [s.name for s in slots] + [f"{n}/{k}" for n, _, k in _extra(state)]
    arrays = [np.array(s.get(), copy=True) for s in slots] + [np.array(o.arrays()[k], copy=True)
                                                              for _, o, k in _extra(state)]
    head = {"names": names, "shapes": [list(a.shape) for a in arrays],
            "dtypes": [a.dtype.str for a in arrays], "keys": keys, "small": small}
    flats = [np.concatenate([a.reshape(-1) for a in arrays if a.dtype.str == d])
             for d in sorted(set(head["dtypes"]))]
    return head, flats


def send_packed(comm, dest: int, packed, tag: int = HEAL_TAG) -> int:
    """Send ``pack_state``'s header and arrays to rank ``dest`` of ``comm``; returns the bytes sent."""
    head, flats = packed
    comm.send_obj(head, dest, tag)
    for flat in flats:
        comm.send(flat, dest, tag)
    return sum(f.nbytes for f in flats)


def recv_state(comm, src: int, state, who: str = "the donor", tag: int = HEAL_TAG) -> int:
    """Receive ``send_packed``'s message from rank ``src`` into ``state``: arrays first, then the small
    state. Returns the payload bytes received. A state of another shape is ``HealFailed``, naming it."""
    head = comm.recv_obj(src, tag)
    slots, finishers = state.slots(optim_keys=head["keys"])
    extra = _extra(state)
    mine = [(s.name, list(s.local_shape()), np.dtype(s.dtype).str) for s in slots]
    mine += [(f"{n}/{k}", list(np.shape(o.arrays()[k])), np.asarray(o.arrays()[k]).dtype.str)
             for n, o, k in extra]
    theirs = list(zip(head["names"], head["shapes"], head["dtypes"]))
    if mine != theirs:
        diff = next(((a, b) for a, b in zip(mine, theirs) if a != b), (len(mine), len(theirs)))
        raise HealFailed(f"rank {comm.rank}: the state of {who} does not fit this replica: first difference "
                         f"{diff[1]} (donor) vs {diff[0]} (here); build the replacement with the same "
                         f"model, mesh and optimizer")
    flats = {d: comm.recv(src, tag) for d in sorted(set(head["dtypes"]))}
    offsets, got = dict.fromkeys(flats, 0), {}
    for name, shape, dtype in theirs:
        n = int(np.prod(shape, dtype=np.int64))
        got[name] = flats[dtype][offsets[dtype]:offsets[dtype] + n].reshape(shape)
        offsets[dtype] += n
    for s in slots:
        s.set(got[s.name])
    for f in finishers:
        f()
    for n, o, k in extra:
        o.load_arrays({k: got[f"{n}/{k}"]})
    state.load_small_state(head["small"], who)
    for f in state.on_load:
        f()
    return sum(f.nbytes for f in flats.values())
