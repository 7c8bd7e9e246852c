"""Exercise 2: write all-reduce from point-to-point messages.

Each function is SPMD code for ONE rank: it is called on every rank of ``comm`` with that rank's
array ``x`` (a 1-D NumPy array, any length, any number of ranks p >= 1) and returns a new array.
Use only ``comm.rank``, ``comm.size``, ``comm.send(x, dest)``, ``comm.recv(source)`` and
``comm.sendrecv(x, dest, source)`` (see minidist/comm/communicator.py), and NumPy -- not
minidist's own collectives (the grader reads the ledger and fails a task that calls one).

Estimated time: 1.5 h (ring 45 min, recursive doubling 30 min, tree broadcast 15 min)
Grade it:  python -m minidist.grade allreduce
The grader runs your functions on 1..8 thread ranks where a send completes only when the
matching receive is posted (as MPI does with large messages: a ring of blocking send-then-recv
is reported as a deadlock, with the cycle of waiting ranks), compares with ``np.sum`` of every rank's x,
reads the ledger (how many messages and bytes each rank sent), counts communication rounds (in
one round a rank sends at most one message and receives at most one; ``sendrecv`` is one round;
see minidist/grading/rounds.py) and checks that your function left the caller's ``x`` as it was.
A crash shows the line of this file it came from. Lesson: lessons/02-allreduce.md.
"""

import numpy as np  # noqa: F401  (you will need it)


def ring_all_reduce(comm, x):
    """Sum of every rank's ``x``, on every rank, by the ring algorithm.

    Split x into p chunks with ``np.array_split`` (lengths need not divide by p). Then, with the
    same convention as minidist's own ring (minidist/comm/ring.py) and chapter 2:
    * reduce-scatter, p-1 steps: at step s send chunk (rank - s - 1) % p to the right neighbour
      (rank + 1) % p, receive chunk (rank - s - 2) % p from the left neighbour and add it to
      yours. Afterwards you hold the complete sum of chunk ``rank``.
    * all-gather, p-1 steps: at step s send chunk (rank - s) % p (you start with your own) and
      receive chunk (rank - s - 1) % p, replacing (not adding) what you had.
    Other conventions are just as right and pass too (ending the reduce-scatter owning chunk
    rank + 1, or running the ring leftwards). Whichever you choose, each rank sends exactly 2(p-1)
    messages -- every chunk but one in each phase, 2·x.nbytes - |chunk a| - |chunk b| bytes for the
    two chunks a != b it never sends, about 2(p-1)/p · x.nbytes -- all ranks together exactly
    2(p-1) · x.nbytes, in 2(p-1) rounds. Use ``comm.sendrecv`` for each step: a plain
    send-then-recv in a ring deadlocks, and even ranks sending first while odd ones receive costs
    two rounds a step. Do not change ``x``: ``np.array_split`` returns views into it, so add into
    copies.
    """
    raise NotImplementedError


def recursive_doubling_all_reduce(comm, x):
    """Sum of every rank's ``x``, on every rank, in about log2(p) steps (whole arrays each step).

    For p a power of two: at step k (distance d = 2**k) exchange your current sum with rank
    ``rank ^ d`` and add. For other p, let q be the largest power of two <= p and rem = p - q:
    first each even rank r < 2*rem sends x to r+1 and waits; the other q ranks run the power-of-two
    algorithm (renumbered 0..q-1); finally each odd rank r < 2*rem sends the result back to r-1.
    Each rank sends at most log2(q) + 1 messages, in log2(q) rounds (plus 2, the fold in and the
    result out, when p is not a power of two).
    """
    raise NotImplementedError


def tree_broadcast(comm, x, root=0):
    """Root's ``x`` on every rank, along a binomial tree (non-roots pass None).

    Number ranks relative to the root: v = (rank - root) % p. A non-root receives once, from
    v minus its lowest set bit; then every rank sends to v + 2**k for each 2**k below its lowest
    set bit (the root: every 2**k < p), if v + 2**k < p, the largest 2**k first (the farthest
    child heads the biggest subtree: sending to it last would start that subtree late, 6 rounds
    at p = 8 instead of 3). Every rank sends at most ceil(log2 p) messages; the whole broadcast
    takes ceil(log2 p) rounds instead of the p-1 of a loop at the root.
    """
    raise NotImplementedError
