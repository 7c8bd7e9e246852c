"""Communication: one Communicator interface, transports, collectives, ledger, process groups.

* ``Communicator`` (communicator.py) -- point-to-point on any transport; ``ThreadComm``
  (threads.py: ranks as threads) and ``MPIComm`` (mpi.py: ranks as MPI processes).
* ``run(fn, ranks)`` (launch.py) -- run SPMD code on every rank with the right transport.
* collectives.py -- ring / recursive-doubling / tree / naive all-reduce, broadcast, reduce,
  all-gather, reduce-scatter, all-to-all, gather, scatter, async versions: all on point-to-point.
* ledger.py -- bytes, messages and steps per rank and per call: ``with measure(comm) as m``.
* call.py -- what every collective does around its messages (host staging, stamp, ledger record).
* mesh.py -- ``Mesh(comm, dp, pp, tp)``; debug.py -- call stamps and ``MINIDIST_DEBUG=1`` checks.
"""

from minidist.comm.collectives import (
    all_gather,
    all_gather_async,
    all_reduce,
    all_reduce_async,
    all_to_all,
    broadcast,
    gather,
    mpi_all_reduce,
    naive_all_reduce,
    recursive_doubling_all_reduce,
    reduce,
    reduce_scatter,
    reduce_scatter_async,
    ring_all_reduce,
    scatter,
    tree_all_reduce,
)
from minidist.comm.communicator import (
    CommError,
    CommTimeout,
    Communicator,
    MessageMismatch,
    RankAborted,
    RankExited,
    Request,
)
from minidist.comm.debug import CollectiveMismatch
from minidist.comm.handles import Handle, start_async
from minidist.comm.ledger import CallRecord, Ledger, measure
from minidist.comm.mesh import Mesh
from minidist.comm.runner import run, under_mpi, world
from minidist.comm.transports.mpi import MPIComm
from minidist.comm.transports.threads import ThreadComm

__all__ = [
    "CallRecord", "CollectiveMismatch", "CommError", "CommTimeout", "Communicator", "Handle", "Ledger",
    "MPIComm", "Mesh", "MessageMismatch", "RankAborted", "RankExited", "Request", "ThreadComm", "all_gather",
    "all_gather_async", "all_reduce", "all_reduce_async", "all_to_all", "broadcast", "gather", "measure",
    "mpi_all_reduce", "start_async",
    "naive_all_reduce", "recursive_doubling_all_reduce", "reduce", "reduce_scatter",
    "reduce_scatter_async", "ring_all_reduce", "run", "scatter", "tree_all_reduce", "under_mpi", "world",
]
