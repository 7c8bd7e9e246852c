"""Healing: a replacement takes a live peer's state over the transport, not from disk.

The donor is the rank at the same position (tensor/pipeline rank) in a participating replica group, so
its arrays have exactly the replacement's layout: no resharding, each array moves once. What moves is
the ``TrainState`` each side is handed, in this order:

1. a header (one small pickled object): every array's name, shape and dtype, the optimizer's state
   keys, and the donor's *small state as it was at the start of the step* -- optimizer scalars,
   every object's ``state_dict`` (data position, step count) and every RNG stream;
2. the arrays -- parameters, then optimizer state (AdamW's m and v) -- one flat message per dtype;
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


def send_state(comm, dest: int, state, small: dict, tag: int = HEAL_TAG) -> int:
    """Send this rank's ``state`` (a ``TrainState``) with ``small`` (its ``small_state()`` at the start
    of the step) to rank ``dest`` of ``comm``; returns the payload bytes sent."""
    keys = _keys(state)
    slots, _ = state.slots(optim_keys=keys)
    arrays = [np.ascontiguousarray(s.get()) for s in slots]
    head = {"names": [s.name for s in slots], "shapes": [list(a.shape) for a in arrays],
            "dtypes": [a.dtype.str for a in arrays], "keys": keys, "small": small}
    comm.send_obj(head, dest, tag)
    sent = 0
    for dtype in sorted({a.dtype.str for a in arrays}):
        flat = np.concatenate([a.reshape(-1) for a in arrays if a.dtype.str == dtype])
        comm.send(flat, dest, tag)
        sent += flat.nbytes
    return sent


def recv_state(comm, src: int, state, who: str = "the donor", tag: int = HEAL_TAG) -> int:
    """Receive ``send_state``'s message from rank ``src`` into ``state``: arrays first, then the small
    state. Returns the payload bytes received. A state of another shape is ``HealFailed``, naming it."""
    head = comm.recv_obj(src, tag)
    slots, finishers = state.slots(optim_keys=head["keys"])
    mine = [(s.name, list(s.local_shape()), np.dtype(s.dtype).str) for s in slots]
    theirs = list(zip(head["names"], head["shapes"], head["dtypes"]))
    if mine != theirs:
        diff = next(((a, b) for a, b in zip(mine, theirs) if a != b), (len(mine), len(theirs)))
        raise HealFailed(f"rank {comm.rank}: the state of {who} does not fit this replica: first difference "
                         f"{diff[1]} (donor) vs {diff[0]} (here); build the replacement with the same "
                         f"model, mesh and optimizer")
    flats = {d: comm.recv(src, tag) for d in sorted(set(head["dtypes"]))}
    offsets = dict.fromkeys(flats, 0)
    got = 0
    for s, shape, dtype in zip(slots, head["shapes"], head["dtypes"]):
        n = int(np.prod(shape, dtype=np.int64))
        s.set(flats[dtype][offsets[dtype]:offsets[dtype] + n].reshape(shape))
        offsets[dtype] += n
    for f in finishers:
        f()
    state.load_small_state(head["small"], who)
    for f in state.on_load:
        f()
    got = sum(f.nbytes for f in flats.values())
    return got
