"""Exercise 3b: ZeRO -- shard the training state over the data-parallel ranks instead of copying it.

Every rank owns one slice of each flat parameter/gradient array (``np.array_split``'s convention):
ZeRO-2 reduce-scatters the gradient so each rank receives only the sum of its own slice, updates
that slice, and all-gathers the new parameters. ZeRO-3 keeps only the slices even between steps,
and gathers each unit (layer) just before it is used -- starting the NEXT unit's gather while this
one computes, so the bytes overlap the compute -- and frees it right after.

Estimated time: 1 h 15 min (shard bounds 10 min, ZeRO-2 step 25 min, ZeRO-3 forward 40 min)
Points: shard_bounds 1, zero2_sgd_step 3, zero3_forward 4.
Grade it:  python -m minidist.grade zero
The grader runs your functions on 1..4 thread ranks against the serial update and forward, reads the
ledger (one reduce-scatter and one all-gather, not an all-reduce) and the order of your gathers and
releases. Lesson: lessons/03-data-parallel.md; minidist's answer is minidist/parallel/data/zero.py.
"""

import numpy as np  # noqa: F401  (you will need it)

from minidist.comm import all_gather, reduce_scatter  # noqa: F401  (you will need them)


def shard_bounds(numel, rank, world):
    """(lo, hi): the slice ``flat[lo:hi]`` that ``rank`` owns of a flat array of ``numel`` elements
    split over ``world`` ranks like ``np.array_split``: the first numel % world ranks own one element
    more. Computed with integer arithmetic, without building the array."""
    raise NotImplementedError


def zero2_sgd_step(comm, params, grad, lr):
    """One ZeRO-2 SGD step on flat float64 arrays; returns the new full ``params`` on every rank.

    ``params`` (N,) is the same on every rank, ``grad`` (N,) is this rank's local gradient. The update
    uses the MEAN gradient over ranks: params - lr * sum(grads) / world. Only this rank's slice
    (``shard_bounds``) is updated here: ``reduce_scatter(comm, grad)`` returns the sum of your slice
    only; then ``all_gather(comm, new_slice, sizes=[...])`` (the slice lengths of every rank) puts
    the full array back together. No all-reduce: together these send the bytes of one all-reduce.
    Does not modify its inputs.
    """
    raise NotImplementedError


def zero3_forward(units, x):
    """x through every unit in order, gathering each unit's weight just in time, prefetching the next.

    ``units`` (given by the grader, the same interface on every rank):
    * ``units.n`` -- how many units; ``units.start_gather(u)`` -- start all-gathering unit u's
      weight from every rank's slice (collective: every rank starts the same gathers in the same
      order); returns a handle whose ``wait()`` returns the full weight;
    * ``units.layer(u, w, x)`` -- unit u's computation with its full weight ``w``: returns the next x;
    * ``units.release(u)`` -- unit u's full weight is no longer needed (free it).
    Rules the grader checks on every rank: each unit is gathered exactly once; unit u+1's gather
    starts BEFORE ``layer(u)`` runs (prefetch); each unit is released right after its layer; never more
    than two units are gathered at once (start unit u+2 only after releasing u).
    Does not modify x.
    """
    raise NotImplementedError
