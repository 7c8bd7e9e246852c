"""Seeded random state, per thread (each threads-transport rank is a thread).

Parameter initialisation and dropout draw from a NumPy ``Generator`` on the host, so the same seed
gives the same numbers on every backend. ``manual_seed`` resets this rank's default generator;
``get_state``/``set_state`` save and replay it (activation recomputation replays dropout masks
with them); ``fork(seed)`` runs a block with another generator (tensor parallelism uses one for
its sharded regions, as Megatron's RNG tracker does).
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np

_local = threading.local()


def default_generator() -> np.random.Generator:
    gen = getattr(_local, "gen", None)
    if gen is None:
        gen = _local.gen = np.random.default_rng(0)
    return gen


def manual_seed(seed: int) -> np.random.Generator:
    _local.gen = np.random.default_rng(seed)
    return _local.gen


def get_state() -> dict:
    return default_generator().bit_generator.state


def set_state(state: dict) -> None:
    default_generator().bit_generator.state = state


@contextlib.contextmanager
def fork(generator_or_seed):
    """Use another generator as the default inside the block; the outer one is left untouched."""
    prev = getattr(_local, "gen", None)
    _local.gen = (generator_or_seed if isinstance(generator_or_seed, np.random.Generator)
                  else np.random.default_rng(generator_or_seed))
    try:
        yield _local.gen
    finally:
        _local.gen = prev
