"""Communication: the Communicator interface, the collectives built on it, and what attaches to it.

* communicator.py -- point-to-point on any transport; transports/ (threads, MPI, JAX devices).
* ring.py, tree.py, doubling.py -- the all-reduce algorithms (and reduce-scatter, all-gather,
  broadcast, reduce); exchange.py -- all-to-all, gather, scatter; collectives.py -- ``all_reduce``
  by name and the async forms (handles.py). call.py -- what every collective does around its messages.
* attached to a communicator, never imported by an algorithm: ledger.py (``with measure(comm)``),
  watchdog.py and waiting.py (bounded waits), debug.py, cost.py (``algorithm="auto"``).
* mesh.py -- ``Mesh(comm, dp, pp, tp)``; runner.py -- ``run(fn, ranks)`` on the right transport.
"""

from minidist.comm.collectives import all_reduce
from minidist.comm.communicator import Communicator
from minidist.comm.debug import CollectiveMismatch
from minidist.comm.doubling import (
    halving_doubling_all_reduce,
    recursive_doubling_all_reduce,
    two_shot_all_reduce,
)
from minidist.comm.exchange import all_to_all, gather, scatter
from minidist.comm.handles import (
    Handle,
    all_gather_async,
    all_reduce_async,
    reduce_scatter_async,
    start_async,
)
from minidist.comm.ledger import CallRecord, Ledger, measure
from minidist.comm.mesh import Mesh
from minidist.comm.requests import (
    CommError,
    CommTimeout,
    MessageMismatch,
    RankAborted,
    RankExited,
    Request,
    default_timeout,
)
from minidist.comm.ring import all_gather, reduce_scatter, ring_all_reduce, split_sizes
from minidist.comm.runner import run, under_mpi, world
from minidist.comm.transports.mpi import MPIComm, mpi_all_reduce
from minidist.comm.transports.shm import shm_all_reduce
from minidist.comm.transports.threads import ThreadComm
from minidist.comm.tree import broadcast, naive_all_reduce, reduce, tree_all_reduce

__all__ = [
    "CallRecord", "CollectiveMismatch", "CommError", "CommTimeout", "Communicator", "Handle", "Ledger",
    "MPIComm", "Mesh", "MessageMismatch", "RankAborted", "RankExited", "Request", "ThreadComm", "all_gather",
    "all_gather_async", "all_reduce", "all_reduce_async", "all_to_all", "broadcast", "gather",
    "halving_doubling_all_reduce", "measure", "mpi_all_reduce", "naive_all_reduce",
    "recursive_doubling_all_reduce", "reduce", "reduce_scatter", "reduce_scatter_async", "ring_all_reduce",
    "run", "scatter", "shm_all_reduce", "split_sizes", "start_async", "tree_all_reduce",
    "two_shot_all_reduce", "under_mpi", "world", "default_timeout",
]
