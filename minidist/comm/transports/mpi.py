"""The MPI transport: ranks are MPI processes (``mpirun -n 8 python ...``, or several hosts).

Arrays travel through mpi4py's buffer API (``Isend``/``Irecv`` on the NumPy memory: zero copy).
JAX and CuPy arrays arrive here already staged to host memory by ``Communicator``.
A message with a header is two MPI messages: a small int64 header (ndim, dtype name, shape) on
tag ``2*tag`` and the payload on tag ``2*tag+1``; raw buffers (``send_buffer``) are only the
payload. Receives with headers post their payload ``Irecv`` strictly in the order they were
posted, so several pending receives from one peer still match the right messages.

Every wait is ``Test`` + sleep with backoff (see ``communicator.poll``): eight ranks waiting on
two cores leave the CPU to whoever computes, and the watchdog can fire. While it sleeps, a wait
also checks its peer: a peer that has returned from ``run()`` (it sent ``DONE_TAG`` on
COMM_WORLD, see launch.py) raises :class:`RankExited`; on a strict private channel, a peer whose next message
carries another collective's stamp raises :class:`CollectiveMismatch` (see debug.py). Every
receive checks the size of what arrived (MPI's status), so a mismatch is an error, not garbage.

This file is the communicator (``MPIComm``) and the end-of-run handshake; the wire format is
``minidist/comm/transports/mpi_wire.py`` and the pending requests
``minidist/comm/transports/mpi_requests.py``, both re-exported here.
"""

from __future__ import annotations

import time

import numpy as np

from minidist.comm import clock, cost
from minidist.comm.call import collective
from minidist.comm.collectives import ALGORITHMS
from minidist.comm.communicator import format_op
from minidist.comm.debug import stamp_mismatch
from minidist.comm.ledger import Ledger
from minidist.comm.requests import RankExited, Request
from minidist.comm.ring import ring_all_reduce
from minidist.comm.transports.mpi_requests import _drain, _MPIHeaderRecv, _MPIRequest
from minidist.comm.transports.mpi_wire import (
    HEADER_LEN,
    MAX_NDIM,
    _bytes,
    _check_count,
    _mpi,
    _truncated,
    decode_header,
    encode_header,
    mpi_knows,
)
from minidist.comm.transports.shm import free_windows, shm_lane
from minidist.comm.waiting import poll
from minidist.comm.watchdog import Watched

__all__ = ["HEADER_LEN", "MAX_NDIM", "NAMESPACE", "CHANNELS", "MPIComm", "decode_header", "done_tag",
           "encode_header", "finish_handshake", "mpi_all_reduce", "mpi_knows"]

NAMESPACE = 1 << 21            # tags per private channel: user tags < 2**20, then minidist's object tags
CHANNELS = {"coll": 1, "debug": 2, "async": 3}


class MPIComm(Watched):
    """One MPI process's end of an ``mpi4py`` communicator (``MPI.COMM_WORLD`` by default)."""

    transport = "mpi"

    def __init__(self, mpicomm=None, backend=None, ledger: Ledger | None = None, namespace: int = 0):
        self.mpi = mpicomm if mpicomm is not None else _mpi().COMM_WORLD
        super().__init__(self.mpi.Get_rank(), self.mpi.Get_size(), backend, ledger)
        self.namespace = namespace
        self.base = 2 * namespace * NAMESPACE  # MPI tag of (tag, header) = base + 2*tag; payload +1
        self._pending: dict = {}  # (source, tag) -> header receives waiting for their payload, in order
        self._statuses = [_mpi().Status(), _mpi().Status()]  # the hot path's: reused, looked up once
        self._testall, self._BYTE = _mpi().Request.Testall, _mpi().BYTE
        self._world_ranks: list | None = None
        self.shm = None         # this communicator's lane of a shared window: None = not asked yet (shm.py)
        self.shm_window = None  # the origin's shm.Window, or None where shared memory can't serve it
        self.clock = process_clock()
        if _BOARD[0] is not None:  # the watchdog reads who of the job is blocked (start_board)
            self.board, self.board_rank = _BOARD[0][2], _mpi().COMM_WORLD.Get_rank()

    def progress(self) -> None:
        """Post the payload receive of every pending receive whose header has arrived.

        Called from every wait: a rank blocked in its own send must still take in a large message
        sent to it, or two ranks exchanging large messages would each wait for the other.
        """
        if self._pending:
            for key in list(self._pending):
                _drain(self._pending, key)

    # -- checks while waiting (slow path only) -----------------------------------------------------
    def world_rank(self, r: int) -> int:
        if self._world_ranks is None:
            MPI = _mpi()
            self._world_ranks = MPI.Group.Translate_ranks(self.mpi.Get_group(), list(range(self.size)),
                                                         MPI.COMM_WORLD.Get_group())
        return self._world_ranks[r]

    def peer_problem(self, peer: int, tag: int, receiving: bool = True):
        """Why ``peer`` may never answer, or None: it has returned from run(), or (strict channel,
        receiving) its next message belongs to another collective call."""
        MPI = _mpi()
        if MPI.COMM_WORLD.Iprobe(self.world_rank(peer), done_tag()):
            return RankExited(f"rank {self.rank} of {self.size} (mpi), in {format_op(self.origin.last_op)}: "
                              f"rank {peer} returned from run() without sending or receiving what this "
                              f"rank waits for (tag {tag})")
        if self.strict and receiving:
            status = MPI.Status()
            if self.mpi.Iprobe(peer, MPI.ANY_TAG, status):
                ns, t = divmod(status.Get_tag(), 2 * NAMESPACE)
                if ns == self.namespace and t // 2 != tag:
                    return stamp_mismatch(self, peer, tag, t // 2)
        return None

    # -- the transport interface ---------------------------------------------------------------
    def isend_buffer(self, buf, dest, tag=0, *, header=False, count=True) -> Request:
        done = arrival = 0.0
        if self.clock is not None:
            done, arrival = self.clock.send(buf.nbytes)  # charged in virtual time, not slept
        elif self.link is not None:
            self.link.pause(buf.nbytes)  # the emulated link is busy for alpha + bytes / bandwidth
        reqs, keep = [], [buf]
        if header:
            h = encode_header(buf)
            self.ledger.count_header(h.nbytes)
            if self.clock is not None:  # the arrival rides in the header's last word
                h = np.concatenate([h, np.array([arrival]).view(np.int64)])
            keep.append(h)
            reqs.append(self.mpi.Isend(h, dest, self.base + 2 * tag))
        elif self.clock is not None:  # no header: the arrival goes alone on the header's tag
            h = np.array([arrival])
            keep.append(h)
            reqs.append(self.mpi.Isend(h, dest, self.base + 2 * tag))
        reqs.append(self.mpi.Isend(_bytes(buf), dest, self.base + 2 * tag + 1))
        if count:
            self.ledger.count_send(buf.nbytes)
        if self.clock is not None:
            self.clock.resume()  # posting the message is the transport's work, not compute
        return _MPIRequest(self, reqs, keep, f"a send to rank {dest} (tag {tag}) to complete", dest, tag,
                           at=done)

    def irecv_buffer(self, out, source, tag=0, *, header=False, count=True) -> Request:
        if header:
            return _MPIHeaderRecv(self, source, tag, out, count)
        if count:
            self.ledger.count_recv(out.nbytes)
        reqs, stamp = [self.mpi.Irecv(_bytes(out), source, self.base + 2 * tag + 1)], None
        if self.clock is not None:
            stamp = np.empty(1)
            reqs.append(self.mpi.Irecv(stamp, source, self.base + 2 * tag))
        return _MPIRequest(self, reqs, [out], f"a message from rank {source} (tag {tag})", source, tag, out,
                           stamp=stamp)

    def sendrecv_buffer(self, sendbuf, dest, recvbuf, source, tag=0, *, header=False):
        """The hot path of every ring and butterfly: one Irecv, one Isend, one wait on both; the
        size of what arrived is checked from MPI's status."""
        if header or self.clock is not None:
            return super().sendrecv_buffer(sendbuf, dest, recvbuf, source, tag, header=header)
        if self.link is not None:
            self.link.pause(sendbuf.nbytes)
        t = self.base + 2 * tag + 1
        reqs = [self.mpi.Irecv(_bytes(recvbuf), source, t), self.mpi.Isend(_bytes(sendbuf), dest, t)]
        self.ledger.count_sendrecv(sendbuf.nbytes, recvbuf.nbytes)
        statuses, testall = self._statuses, self._testall
        try:
            if not testall(reqs, statuses):  # (already done: no closures to build)
                poll(lambda: testall(reqs, statuses), self, lambda: f"sendrecv: to {dest}, from {source}",
                     lambda: self.peer_problem(source, tag))
        except _mpi().Exception as e:
            raise _truncated(self, source, tag, recvbuf.nbytes, e) from None
        if statuses[0].Get_count(self._BYTE) != recvbuf.nbytes:
            _check_count(self, statuses[0], source, tag, recvbuf.nbytes)
        return recvbuf

    def all_reduce_algorithm(self, x, op: str) -> str:
        """``auto``: shared memory where every rank is on one node (``cost.shm_wins``), else the
        cost model's choice; every rank agrees (the window and crowding are agreed once)."""
        lane = self.shm
        if lane and (x.nbytes <= lane.cap or lane.crowded):  # the common case, decided
            return "shm"
        if lane is None or self.agreed_crowded is None:
            cost.check_before_handshake(self, x, op, "auto")
        if lane is None and shm_lane(self) and cost.shm_wins(x.nbytes, self.shm.cap, self.shm.crowded):
            return "shm"
        return cost.choose_algorithm(x.nbytes, self.size, cost.agreed_crowded(self))

    def make_channel(self, name: str) -> MPIComm:
        """A private channel on the same MPI communicator with its own range of tags (no MPI call, so it can't
        hang); MPI's ``Dup`` only if the tag range would pass the MPI library's TAG_UB."""
        ns = self.namespace * 4 + CHANNELS.get(name, 3)
        if 2 * (ns + 1) * NAMESPACE <= self.mpi.Get_attr(_mpi().TAG_UB):
            return MPIComm(self.mpi, self.backend, self.ledger, ns)
        self.note(f"creating the private communicator {name!r}")
        self.barrier()  # our barrier has the watchdog; MPI's Dup would wait forever for a missing rank
        return MPIComm(self.mpi.Dup(), self.backend, self.ledger)

    def split(self, color, key=0):
        MPI = _mpi()
        self.note(f"split(color={color}, key={key})")
        self.barrier()  # everyone is here (watchdog-protected), so MPI's Split can't hang
        new = self.mpi.Split(MPI.UNDEFINED if color is None or color < 0 else color, key)
        if new == MPI.COMM_NULL:
            return None
        return MPIComm(new, self.backend, Ledger(parent=self.ledger))


_CLOCK: list = []  # [RankClock or None]: this process's rank's virtual clock


def process_clock():
    """This process's virtual clock (one rank: every communicator of it shares one), or None."""
    if not _CLOCK:
        _CLOCK.append(clock.RankClock() if clock.enabled() else None)
    return _CLOCK[0]


_BOARD: list = [None]  # [(window, node communicator, float64 array)]: this job's board, or None


def start_board() -> None:
    """The watchdog's board (``Watched.mark_waiting``), a float64 per rank in the node's shared memory.
    Collective over COMM_WORLD (run()'s start); none where the ranks span several nodes."""
    MPI = _mpi()
    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    if node.Get_size() != world.Get_size():  # every rank sees the same: all on one node, or not
        return node.Free()
    win = MPI.Win.Allocate_shared(8 * world.Get_size() if node.Get_rank() == 0 else 0, 8, comm=node)
    board = np.frombuffer(win.Shared_query(0)[0], np.float64)
    if node.Get_rank() == 0:
        board[:] = 0.0
    node.Barrier()
    _BOARD[0] = (win, node, board)


def end_board(finished: bool) -> None:
    """This rank returned (-1 on its slot); with ``finished`` (every rank has: collective) free it."""
    if _BOARD[0] is not None:
        win, node, board = _BOARD[0]
        board[_mpi().COMM_WORLD.Get_rank()] = -1.0
        if finished:
            _BOARD[0] = None
            win.Free()
            node.Free()


# -- the completion handshake (launch.py): every rank tells every other that it has finished --------

_DONE_TAG: list = []


def done_tag() -> int:
    """A tag no namespace uses: TAG_UB itself (namespaces end below it, see ``make_channel``)."""
    if not _DONE_TAG:
        _DONE_TAG.append(_mpi().COMM_WORLD.Get_attr(_mpi().TAG_UB))
    return _DONE_TAG[0]


def finish_handshake(comm: MPIComm) -> None:
    """Tell every other rank of COMM_WORLD that this one has returned from its function (a peer
    still waiting for it raises ``RankExited`` at once), then wait until every rank has said so.
    No timeout: a peer may legitimately compute long after us; a dead peer ends the job (mpirun)."""
    MPI = _mpi()
    world, token = MPI.COMM_WORLD, np.zeros(0, np.uint8)
    peers = [r for r in range(world.Get_size()) if r != world.Get_rank()]
    tag = done_tag()
    reqs = [world.Isend(token, r, tag) for r in peers]
    reqs += [world.Irecv(np.zeros(0, np.uint8), r, tag) for r in peers]
    comm.note("finished: waiting for the other ranks to finish run()")
    end_board(False)
    delay = 1e-4
    while not MPI.Request.Testall(reqs):
        time.sleep(delay)
        delay = min(2 * delay, 0.05)
    free_windows()  # collective, and every rank has finished: nobody uses a window any more
    end_board(True)


def mpi_all_reduce(comm, x, op: str = "sum"):
    """MPI's own ``Allreduce`` (buffer API) under MPI; on other transports the ring all-reduce.

    Blocking inside MPI (no watchdog, no stamps: only debug mode compares the ranks' calls): it is
    the yardstick, not part of minidist's algorithms, so it runs with nothing added.
    """
    if comm.transport != "mpi" or comm.clock is not None:  # (the clock can't see inside MPI's own)
        return ring_all_reduce(comm, x, op)
    MPI = _mpi()
    with collective(comm, "mpi_all_reduce", x, op=op) as k:
        if not mpi_knows(k.host.dtype):
            raise TypeError(f"rank {comm.rank}: MPI's Allreduce can't reduce {k.host.dtype} (it doesn't know "
                            f"the type); use one of minidist's algorithms, e.g. algorithm='ring'")
        buf = k.host.copy()
        mop = {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op]
        k.comm.mpi.Allreduce(MPI.IN_PLACE, buf, op=mop)
        return k.be.from_host(k.finish(buf))


ALGORITHMS["mpi"] = mpi_all_reduce
