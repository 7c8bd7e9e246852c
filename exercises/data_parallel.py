"""Exercise 3: the two pieces of data parallelism that are easy to get subtly wrong.

Every rank holds the whole model and a slice of the global batch. After backward each rank's
gradients are summed across ranks -- not one message per parameter, but in *buckets* of
parameters whose gradients travel together, started while backward is still running.

Estimated time: 45 min (buckets 20 min, averaging 25 min)
Grade it:  python -m minidist.grade data_parallel
The grader compares your buckets with minidist's DDP and your averaged gradients, on 1..5 thread
ranks with uneven batches, with the serial gradient of the whole global batch.
Lesson: lessons/03-data-parallel.md; minidist's answer is build_buckets in minidist/parallel/data/buckets.py
and DistributedDataParallel.backward and wait_gradients in minidist/parallel/data/ddp.py, so try before
you look.
"""

import numpy as np  # noqa: F401  (you will need it)

from minidist.comm import all_reduce  # noqa: F401  (you will need it)


def build_buckets(param_sizes_bytes, bucket_bytes):
    """Group parameters 0..n-1 (``param_sizes_bytes[i]`` bytes each, in the model's order) into
    buckets: a list of lists of parameter indices.

    Walk the parameters in REVERSE order (n-1 first: backward produces the last layer's gradients
    first, so that bucket can start communicating earliest). Add each to the current bucket unless
    that would take it over ``bucket_bytes``; then close the bucket and start a new one. A bucket
    exactly ``bucket_bytes`` big is fine; a parameter larger than ``bucket_bytes`` gets a bucket of
    its own. Example: sizes [4, 4, 4, 8], bucket_bytes 8 -> [[3], [2, 1], [0]].
    Does not modify its inputs.
    """
    raise NotImplementedError


def average_gradients(comm, grads, n_local):
    """The gradient of the mean loss over the GLOBAL batch, on every rank.

    SPMD code for one rank of ``comm``: ``grads`` is a list of float64 arrays, the gradient of the
    mean loss over this rank's ``n_local`` samples (``n_local`` may differ between ranks, and may be
    0 on some: then its grads are zeros). Return a list of arrays of the same shapes, equal on every
    rank to the gradient the serial program gets from the mean over all N = sum of n_local samples.
    Hint: the mean over N is not the mean of the ranks' means. Use ``all_reduce(comm, x)`` (the sum).
    Does not modify its inputs.
    """
    raise NotImplementedError
