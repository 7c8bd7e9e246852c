"""Exercise 8: offload the optimizer state to disk, and hide the disk behind the update.

The optimizer state (momentum here, Adam's two moments in minidist) can be larger than the model.
Offloading keeps it on disk, in shards of about ``shard_bytes``: each step loads a shard, updates its
parameters, writes the new state back. Done naively, the step waits for the disk at every shard;
prefetching the next shard's load while this one computes hides most of that wait.

Estimated time: 45 min (shards 15 min, the prefetching step 30 min)
Points: make_shards 2, offloaded_momentum_step 4.
Grade it:  python -m minidist.grade offload
The grader compares with momentum SGD kept in memory, on a real directory of .npy files read by a
background thread, and reads the order of your loads, updates and saves.
Lesson: lessons/08-offload.md; minidist's answer is OffloadedAdamW in minidist/parallel/memory/offload.py.
"""

import numpy as np  # noqa: F401  (you will need it)


def make_shards(nbytes, shard_bytes):
    """Parameter indices 0..len(nbytes)-1 grouped into consecutive shards, in order: start a new shard
    when adding the next parameter would make the current one exceed ``shard_bytes``; a parameter
    larger than shard_bytes is a shard alone. E.g. nbytes [4, 4, 4, 10, 1], shard_bytes 8 ->
    [[0, 1], [2], [3], [4]]. Does not modify its inputs."""
    raise NotImplementedError


def offloaded_momentum_step(store, params, grads, lr, beta):
    """One momentum-SGD step with the momentum on disk; updates ``params`` (a list of arrays) in place.

    For each parameter i: m_i = beta * m_i + g_i, then p_i -= lr * m_i.
    ``store`` (given by the grader): ``store.shards`` -- the list of shards (lists of parameter
    indices, as make_shards gives); ``store.load_async(s)`` -- start reading shard s's momentum from
    disk, returns a handle whose ``wait()`` gives a list of arrays (one per parameter of the shard);
    ``store.save(s, arrays)`` -- write shard s's new momentum back.
    Rules the grader checks: each shard loaded and saved exactly once; shard s+1's load starts
    BEFORE shard s is saved (prefetch: the disk works while you compute); never more than two shards
    in memory (start loading s+2 only after saving s).
    Does not modify grads (only params).
    """
    raise NotImplementedError
