"""ZeRO (Rajbhandari et al. 2020): data parallelism that shards the training state instead of copying it.

``ZeRO(model, comm, optimizer, stage=k)`` builds stage k's class, each on ``sharded.py``'s
``ShardedDataParallel`` (rank r owns the slice ``Bucket.shard(r, N)`` of every flat bucket):

* **1** (``ZeRO1``) -- optimizer state sharded: backward keeps the whole gradient; ``step``
  reduce-scatters each bucket, updates my slice, all-gathers the parameters. Bytes 2Ψ, as DP.
* **2** (``ZeRO2``) -- gradients sharded too: DDP's hook starts each bucket's reduce-scatter as soon
  as it is complete, and only my slice is kept. Bytes 2Ψ.
* **3** (``ZeRO3``, ``zero3.py``) -- parameters sharded too: each unit is all-gathered just before
  its forward (and again for its backward) and freed after. Bytes 3Ψ, 1.5x DP.

Per-rank memory (``memory_arrays``) follows ``minidist.nn.footprint.zero_formula``; loss weighting
and ``no_sync`` are DDP's.
"""

from __future__ import annotations

from minidist.parallel.data.buckets import Bucket
from minidist.parallel.data.sharded import ShardedDataParallel, all_gather_flat, param_count
from minidist.parallel.data.zero3 import ZeRO3


def ZeRO(module, comm, optimizer, stage: int = 2, bucket_bytes: float = 4 << 20, **kwargs):
    """``ZeRO(model, comm, lambda ps: AdamW(ps, lr=1e-3), stage=2)``: the stage's class; train with
    ``zero.backward(loss, n_samples)`` and ``zero.step()``. Keywords: ``units``, ``broadcast_from``,
    ``prefetch`` (stage 3)."""
    stages = {1: ZeRO1, 2: ZeRO2, 3: ZeRO3}
    if stage not in stages:
        raise ValueError(f"rank {comm.rank}: ZeRO stage must be 1, 2 or 3, got {stage!r}")
    return stages[stage](module, comm, optimizer, bucket_bytes=bucket_bytes, **kwargs)


class ZeRO1(ShardedDataParallel):
    """Stage 1: only the optimizer state is sharded. Backward keeps the whole gradient as in serial
    training; ``step`` reduce-scatters every bucket, updates this rank's slice, all-gathers the
    parameters. On an in-place backend the flat bucket becomes the gradient storage (the ``p.grad``
    are views of it) and the reduced slice is written back into it."""

    stage = 1

    def __init__(self, *args, **kwargs):
        self._flats: dict[int, object] = {}  # bucket index -> its flat gradient (in-place backends)
        super().__init__(*args, **kwargs)

    def grad_ready(self, p):
        """Backward only accumulates: stage 1 communicates in ``step`` (``wait_gradients`` starts
        every bucket there)."""
        self.window.hooked = True

    def reduce(self, b: Bucket, flat):
        """Reduce-scatter the whole accumulated gradient of bucket ``b``, keeping the full buffer."""
        if b.params[0].backend.inplace:
            self._flats[b.index] = flat
            for p, v in zip(b.params, b.views(flat)):
                p.grad = v
        return super().reduce(b, flat)

    def finish(self, b: Bucket, mine, divisor: float):
        """My slice of the summed gradient steps my optimizer shard (and goes back into the buffer)."""
        super().finish(b, mine, divisor)
        flat = self._flats.pop(b.index, None)
        if flat is not None:
            lo, hi = b.shard(self.comm.rank, self.comm.size)
            flat[lo:hi] = self.shards[b.index].grad
            self.shards[b.index].grad = flat[lo:hi]

    def zero_grad(self):
        super().zero_grad()
        self._flats.clear()


class ZeRO2(ShardedDataParallel):
    """Stage 2: gradients sharded too. DDP's hook starts each bucket's reduce-scatter (``reduce``) as
    soon as the bucket is complete; ``start_bucket`` has already dropped the full gradients, the flat
    copy lives only as long as the collective, and ``finish`` keeps only this rank's slice."""

    stage = 2


__all__ = ["ZeRO", "ZeRO1", "ZeRO2", "ZeRO3", "ShardedDataParallel", "all_gather_flat", "param_count"]
