"""``all_reduce`` by name: every all-reduce algorithm, chosen per call or by the communicator.

=====================================  =============================  ====================
all-reduce algorithm                   bytes sent per rank (N bytes)  steps (rounds)
=====================================  =============================  ====================
ring (ring.py)                         2(p-1)/p N  [1]                2(p-1)
recursive_doubling (doubling.py)       N log2 p  (p a power of 2)     log2 p (+2 if not)
halving_doubling (doubling.py)         2(p-1)/p N  (p a power of 2)   2 log2 p (+2 if not)
two_shot (doubling.py)                 2(p-1)/p N                     2
tree (tree.py: reduce + broadcast)     <= 2 N ceil(log2 p)            2 ceil(log2 p)
naive (tree.py: through rank 0)        root (p-1) N, others N         2(p-1)
shm (transports/shm.py, one node)      N into shared memory           1 per piece (two-shot 2)
=====================================  =============================  ====================

[1] exactly ``2N - |c_r| - |c_{r+1}|`` with ``c = np.array_split(x.ravel(), p)``. reduce_scatter
(ring) sends ``N - |c_r|``, all_gather (ring) (p-1)/p of its output. ``algorithm="auto"`` asks the
communicator (``comm.all_reduce_algorithm``: the transport's cost model, cost.py), so every rank
runs the same one; ``"mpi"`` (MPI's own) and ``"shm"`` are the MPI transport's, registered here.
"""

from __future__ import annotations

from minidist.comm.doubling import (
    halving_doubling_all_reduce,
    recursive_doubling_all_reduce,
    two_shot_all_reduce,
)
from minidist.comm.ring import ring_all_reduce
from minidist.comm.tree import naive_all_reduce, tree_all_reduce

ALGORITHMS = {"ring": ring_all_reduce, "recursive_doubling": recursive_doubling_all_reduce,
              "halving_doubling": halving_doubling_all_reduce, "two_shot": two_shot_all_reduce,
              "tree": tree_all_reduce, "naive": naive_all_reduce}  # + "mpi", "shm" (transports/)


def all_reduce(comm, x, op: str = "sum", algorithm: str = "auto"):
    """The reduction (sum/mean/max/min) of every rank's x, on every rank, by ``algorithm``."""
    if algorithm == "auto":
        algorithm = comm.all_reduce_algorithm(x, op)
    fn = ALGORITHMS.get(algorithm)
    if fn is None:
        raise ValueError(f"rank {comm.rank}: unknown algorithm {algorithm!r}; use one of "
                         f"{('auto', *ALGORITHMS)}")
    return fn(comm, x, op)
