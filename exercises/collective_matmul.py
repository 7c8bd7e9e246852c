"""Exercise 4b: collective matmul -- an all-gather and a reduce-scatter hidden inside the matmul.

Sequence-parallel tensor parallelism (lessons/04-tensor-parallel.md) all-gathers the sequence before a
column-parallel matmul and reduce-scatters it after a row-parallel one, and waits for each. Cut both
along the sequence into p chunks and pass them round a ring: every step multiplies the chunk in hand
while the next one travels. Both functions are SPMD code for ONE rank of ``comm`` (p ranks), on
NumPy arrays. Use only ``comm.rank``, ``comm.size`` and the non-blocking point-to-point messages
``comm.isend(x, dest)`` / ``comm.irecv(source)`` (each returns a request; ``.wait()`` finishes it,
and the irecv's returns the array) -- not minidist's collectives (the grader reads the ledger and
fails a task that calls one, or sends more than the ring's messages).

The point is the overlap: start each hop, multiply the chunk in hand, THEN wait for the hop. The
grader logs, per rank, when each transfer starts and finishes and when each matrix product runs,
and fails a solution whose transfers finish before the multiply beside them (a blocking
``sendrecv``, or waiting first). Its sends complete only when the receiver has posted its receive,
as MPI's large messages do, so a ring of blocking ``send`` then ``recv`` deadlocks there.

Estimated time: 45 min

Grade it:  python -m minidist.grade collective_matmul
The grader runs your functions on 1..4 ranks with random shapes, compares them with the
all-gather / reduce-scatter written out, counts each rank's messages and bytes, and checks the
order of its transfers and multiplies.
minidist's answer is minidist/parallel/tensor/collective_matmul.py (gather_ring, reduce_scatter_ring):
try first.
"""

import numpy as np  # noqa: F401  (you will need it)


def all_gather_matmul(comm, x, w):
    """``concatenate([x of rank 0, ..., x of rank p-1], axis=1) @ w`` without an all-gather.

    x (B, t, k): this rank's chunk of the sequence (every rank's has the same shape); w (k, n).
    Return (B, p·t, n). Ring: at step s = 0 .. p-1 you hold rank (rank - s) % p's chunk (your own at
    s = 0); start sending it to rank (rank + 1) % p and receiving the next from (rank - 1) % p, then
    multiply the chunk in hand into its place of the output (rows (rank - s) % p), then wait for
    the transfer. p-1 messages of x.nbytes per rank, none on the last step.
    Does not modify its inputs.
    """
    raise NotImplementedError


def matmul_reduce_scatter(comm, x, w):
    """This rank's sequence chunk of ``Σ over ranks of x @ w`` without a reduce-scatter.

    x (B, T, k): this rank's input features of the whole sequence (T divisible by p); w (k, n).
    Return (B, T/p, n): chunk ``rank`` (rows rank·T/p .. (rank+1)·T/p) of the sum over all ranks of
    their ``x @ w``. Ring: at step s compute your part of chunk (rank - s - 1) % p, add the running
    sum received from rank (rank - 1) % p (none at s = 0) and, except at the last step (where the
    chunk is your own and complete), send the sum on to (rank + 1) % p. p-1 messages of one chunk.
    Does not modify its inputs.
    """
    raise NotImplementedError
