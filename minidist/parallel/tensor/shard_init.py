"""Initialising a sharded parameter exactly as the serial twin would, then keeping this rank's part.

``sharded_normal`` draws the *full* weight from the same generator, in the same order, as the serial
model (``minidist.nn``) and keeps this rank's ``Shard`` of it, so a tensor-parallel model starts
equal to the serial one whatever the split. Re-exported by ``minidist.parallel.tensor.layers``.
"""

from __future__ import annotations

import numpy as np

from minidist.accel.backend import default_backend, get_backend
from minidist.autograd import random as mrandom
from minidist.nn.module import Parameter
from minidist.parallel.tensor.shard import Shard


def sharded_normal(shape, std, dtype, comm, shard: Shard, rng=None, backend=None) -> Parameter:
    """Draw the full (serial) weight from ``rng`` on the host, keep this rank's ``shard`` of it."""
    rng = rng if rng is not None else mrandom.default_generator()
    full = get_backend("numpy").random_normal(rng, shape, dtype, scale=std)  # as Backend.random_normal
    be = get_backend(backend) if backend is not None else default_backend()
    return Parameter(be.from_host(np.array(shard.split(full, comm.rank, comm.size), order="C")))


def _zeros(n, dtype, backend) -> Parameter:
    be = get_backend(backend) if backend is not None else default_backend()
    return Parameter(be.from_host(np.zeros((n,), dtype=dtype)))
