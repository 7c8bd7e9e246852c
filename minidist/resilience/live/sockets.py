"""The fabric over TCP: one process per member, any process may join, a dead one is noticed at once.

Why not MPI: under ``mpirun`` a process that is killed ends the whole job (MPICH's launcher tears
every rank down, even with ``-disable-auto-cleanup``), and MPI has no way to add a process to a
running communicator except ``MPI_Comm_spawn`` from inside it. ULFM's revoke / shrink / agree would
do it where the MPI has them working (chapter 10). So under ``mpirun`` the MPI processes are agents
(launch.py) and the training ranks are their children, talking over this fabric.

``SocketWorld`` is one process's end: a listening socket, a reader thread per peer that drops each
message into the mailbox the threads transport uses (so ``SocketComm`` *is* a ``LiveComm``: the same
receives, revocation and lost-member errors), and one outgoing connection per peer, opened at the
first send. A connection that ends is a lost member: its receives raise at once. A frame is a small
pickled header (context, source, destination, tag, dtype, shape) and the raw bytes of the array.
"""

from __future__ import annotations

import pickle
import socket
import struct
import threading
from collections import defaultdict

import numpy as np

from minidist.comm.requests import RankExited
from minidist.comm.transports.mpi_wire import HEADER_LEN
from minidist.comm.transports.threads import _Done
from minidist.resilience.live.errors import Unreachable
from minidist.resilience.live.fabric import LiveComm, LiveWorld
from minidist.resilience.live.links import accept_forever, recv_exact


class _Same(list):
    """One condition for every member id: this process receives for one member only."""

    def __getitem__(self, i):
        return list.__getitem__(self, 0)


class SocketWorld(LiveWorld):
    """One process's end of the TCP fabric (see the module docstring)."""

    def __init__(self, host: str = "127.0.0.1"):
        super().__init__()
        self.member = None
        self.conds = _Same([threading.Condition()])
        self.last_ops = defaultdict(lambda: "start")
        self.board = None             # one member per process: the watchdog sees no other member's wait
        self.addresses: dict = {}     # member -> (host, port), from the coordinator
        self.out: dict = {}           # member -> (socket, lock)
        self.out_lock = threading.Lock()
        self.server = socket.create_server((host, 0))
        self.address = self.server.getsockname()[:2]
        threading.Thread(target=accept_forever, args=(self.server, self._read, "live-data-read"), daemon=True,
                         name="live-data-accept").start()

    def refuse(self) -> None:
        """Stop accepting connections: peers that try to reach this member fail (a fault)."""
        self._close_server()

    def _close_server(self) -> None:
        try:
            self.server.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (close alone would not)
        except OSError:
            pass
        self.server.close()


    def _read(self, conn) -> None:
        head = recv_exact(conn, 8)
        if head is None:
            return
        peer = struct.unpack("<q", head)[0]
        while True:
            try:
                sizes = recv_exact(conn, 16)
                if sizes is None:
                    break
                nh, nb = struct.unpack("<QQ", sizes)
                key, had_header, dtype, shape = pickle.loads(recv_exact(conn, nh))
                body = recv_exact(conn, nb) if nb else bytearray()
            except (OSError, TypeError):
                break
            self.deposit(key, np.frombuffer(body, np.dtype(dtype)).reshape(shape), had_header)
        self.lose(peer, "ended (its connection closed)")

    def deposit(self, key, arr, had_header) -> None:
        """A message for this process's member: numbered in arrival order per (context, source, tag)."""
        cond = self.conds[0]
        with cond:
            seq = self.sent.get(key, 0)
            self.sent[key] = seq + 1
            self.box[(key, seq)] = (arr, had_header, 0.0)
            queued = self.queued.setdefault(key[:-1], {})
            queued[key[-1]] = queued.get(key[-1], 0) + 1
            cond.notify_all()

    def _connection(self, dest: int):
        with self.out_lock:
            if dest not in self.out:
                if dest not in self.addresses:
                    raise Unreachable(f"member {self.member}: no address known for member {dest}")
                try:
                    s = socket.create_connection(tuple(self.addresses[dest]), timeout=10)
                    s.settimeout(None)
                    s.sendall(struct.pack("<q", self.member))
                except OSError as e:
                    raise Unreachable(f"member {self.member} cannot reach member {dest} at "
                                      f"{self.addresses[dest]}: {e}") from None
                self.out[dest] = (s, threading.Lock())
            return self.out[dest]

    def transmit(self, dest: int, key, buf: np.ndarray, had_header: bool) -> None:
        if dest == self.member:
            self.deposit(key, np.array(buf, copy=True), had_header)
            return
        if dest in self.lost:
            raise RankExited(f"member {self.member}: member {dest} was lost ({self.lost[dest]}); not sending")
        s, lock = self._connection(dest)
        head = pickle.dumps((key, had_header, buf.dtype.str, buf.shape), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            with lock:
                s.sendall(struct.pack("<QQ", len(head), buf.nbytes) + head)
                if buf.nbytes:
                    s.sendall(memoryview(np.ascontiguousarray(buf)).cast("B"))
        except OSError as e:
            raise Unreachable(f"member {self.member}: the link to member {dest} broke: {e}") from None

    def close(self) -> None:
        self._close_server()
        for s, _ in self.out.values():
            try:
                s.close()
            except OSError:
                pass


class SocketComm(LiveComm):
    """A ``LiveComm`` whose sends go over TCP (receives are the threads transport's, from the mailbox)."""

    transport = "tcp"

    def isend_buffer(self, buf, dest, tag=0, *, header=False, count=True):
        self._check(f"sent to rank {dest}")
        key = self._key(self.rank, dest, tag)
        self.world.transmit(self.members[dest], key, np.ascontiguousarray(buf), header)
        if count:
            self.ledger.count_send(buf.nbytes)
        if header:
            self.ledger.count_header(8 * HEADER_LEN)
        return _Done()
