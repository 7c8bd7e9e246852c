"""The default communication hook, a plain all-reduce, and running any hook outside DDP."""

from __future__ import annotations

from minidist.comm import all_reduce
from minidist.parallel.data.buckets import GradBucket


def allreduce_hook(state, bucket: GradBucket):
    """The default: the bucket's all-reduce (sum), what DDP does without a hook."""
    return bucket.start(lambda c, x: all_reduce(c, x, op="sum", algorithm=bucket.algorithm), bucket.flat,
                        f"all-reduce b{bucket.index}")


def reduce_with_hook(comm, state, hook, flat, shapes=None, index: int = 0, algorithm: str = "ring"):
    """Run ``hook`` on one bucket outside DDP and wait: the summed (decoded) gradient. For tests,
    lessons and the exercise; ``shapes`` defaults to one 1-D tensor."""
    bucket = GradBucket(index, flat, shapes or [flat.shape], comm, algorithm=algorithm)
    return hook(state, bucket).wait()
