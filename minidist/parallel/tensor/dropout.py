"""Dropout in tensor parallelism's sharded regions (Megatron's RNG tracker).

In replicated regions every rank of the group draws the same mask from the default generator
(seeded alike): plain ``minidist.nn.layers.Dropout``. Under sequence parallelism dropout acts on
sequence shards and each rank needs a different mask: ``SequenceParallelDropout`` takes the rank's
slice of the full mask the serial model would draw (the default: results don't depend on tp), or,
with a ``ShardedRNG``, a per-rank generator's (Megatron's way: no wasted draws, results depend on tp).
"""

from __future__ import annotations

import numpy as np

from minidist.accel.backend import backend_of
from minidist.autograd import ops
from minidist.autograd import random as mrandom
from minidist.nn.layers import Dropout
from minidist.parallel.tensor.comm import SEQ_AXIS


class ShardedRNG:
    """Megatron's model-parallel RNG: one generator per tensor-parallel rank, for sharded regions;
    ``with tracker.fork(): ...`` makes it the default generator inside the block only."""

    OFFSET = 2718  # Megatron adds 2718 + tp_rank to the seed

    def __init__(self, seed: int, tp_rank: int):
        self.generator = np.random.default_rng([seed, self.OFFSET, tp_rank])

    def fork(self):
        return mrandom.fork(self.generator)


class SliceOfFullDropout(ops.Dropout):
    """Dropout whose mask is my slice (along ``axis``) of the full mask ``rng`` would draw for the
    serial model: the same numbers as ``ops.Dropout``, whatever the split. Backward is ``ops.Dropout``'s."""

    @staticmethod
    def forward(ctx, x, p, rng, axis, rank, size):
        shape = list(x.shape)
        shape[axis] *= size
        mine = np.split(ops.dropout_mask(shape, p, rng, x.dtype), size, axis=axis)[rank]
        mask = backend_of(x).from_host(np.ascontiguousarray(mine))
        ctx.save(mask)
        return x * mask


class SequenceParallelDropout(Dropout):
    """Dropout on a sequence shard (B, T/tp, C): the serial model's masks, or ``sharded_rng``'s."""

    def __init__(self, p, comm, sharded_rng: ShardedRNG | None = None):
        super().__init__(p)
        self.comm, self.sharded_rng = comm, sharded_rng

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        if self.sharded_rng is not None:
            with self.sharded_rng.fork() as gen:
                return ops.dropout(x, self.p, gen, True)
        return SliceOfFullDropout.apply(x, p=self.p, rng=mrandom.default_generator(), axis=SEQ_AXIS,
                                        rank=self.comm.rank, size=self.comm.size)


def make_dropout(p, comm, sequence_parallel: bool, sharded_rng=None):
    """Plain (replicated-region) dropout, or the sequence-parallel one."""
    return SequenceParallelDropout(p, comm, sharded_rng) if sequence_parallel else Dropout(p)
