"""The threads transport: N ranks as N threads of one Python process (no MPI needed).

A message is a copy of the sender's NumPy buffer, dropped into the receiver's mailbox under
the key (context, source, destination, tag) with a sequence number; receives take messages in
the order they were posted, exactly as MPI matches them. A waiting rank sleeps on its own
condition variable, so it costs no CPU. Sends never block (the mailbox is unbounded).

``ThreadWorld`` is the shared state of one ``run()``: mailboxes, one condition per rank, each
rank's current operation (for the watchdog), the abort flag set when any rank fails, and the
ranks whose function has returned -- a receive waiting for one of those raises at once.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from minidist.comm import clock
from minidist.comm.communicator import format_op
from minidist.comm.debug import stamp_mismatch
from minidist.comm.ledger import Ledger
from minidist.comm.requests import MessageMismatch, RankAborted, RankExited, Request
from minidist.comm.transports.mpi_wire import HEADER_LEN
from minidist.comm.watchdog import Watched


class ThreadWorld:
    """What the ranks of one threads-transport run share."""

    def __init__(self, size: int):
        self.size = size
        self.conds = [threading.Condition() for _ in range(size)]
        self.box: dict = {}          # (key, seq) -> (array, had_header)
        self.sent: dict = {}         # key -> number of messages sent on it
        self.posted: dict = {}       # key -> number of receives posted on it
        self.queued: dict = {}       # (context, source, destination) -> {tag: messages in the box}
        self.last_ops = ["start"] * size
        self.failed: int | None = None  # the first rank that raised
        self.finished: set = set()   # ranks whose function returned
        self.clocks = [clock.RankClock() for _ in range(size)] if clock.enabled() else None
        self.board = [0.0] * size    # per rank: 0 working, else blocked in a wait since; -1 returned

    def abort(self, rank: int) -> None:
        if self.failed is None:
            self.failed = rank
        self.wake_all()

    def finish(self, rank: int) -> None:
        self.finished.add(rank)
        self.board[rank] = -1.0
        self.wake_all()

    def wake_all(self) -> None:
        for c in self.conds:
            with c:
                c.notify_all()


class _Done(Request):
    def test(self):
        return True

    def wait(self):
        return None


class _Sent(_Done):
    """A buffered send on the virtual clock: its wait ends when the sender's link has pushed it."""

    def __init__(self, clock, done: float):
        self.clock, self.done = clock, done

    def wait(self):
        self.clock.pause()
        self.clock.resume(self.done)


class _ThreadRecv(Request):
    def __init__(self, comm: ThreadComm, source: int, key, seq, out, header, count):
        self.comm, self.source, self.key, self.seq = comm, source, key, seq
        self.out, self.header, self.count = out, header, count
        self.cond = comm.world.conds[comm.world_rank]
        self.result, self.arrival = None, 0.0

    def test(self) -> bool:
        if self.result is None:
            world = self.comm.world
            with self.cond:
                msg = world.box.pop((self.key, self.seq), None)
                if msg is not None:
                    world.queued[self.key[:-1]][self.key[-1]] -= 1
            if msg is not None:
                self._deliver(*msg)
        return self.result is not None

    def problem(self):
        with self.cond:
            return None if (self.key, self.seq) in self.comm.world.box else self._problem()

    def _problem(self):
        """Why the message can never come (called with the condition held), or None."""
        c, world, src = self.comm, self.comm.world, self.key[1]
        if world.failed is not None:
            return RankAborted(f"rank {c.rank}: rank {world.failed} failed while this rank waited for a "
                               f"message from rank {self.source}")
        if c.strict:  # the peer's queued message belongs to another collective call
            for tag, n in world.queued.get(self.key[:-1], {}).items():
                if n and tag != self.key[-1]:
                    return stamp_mismatch(c, self.source, self.key[-1], tag)
        if src in world.finished:
            return RankExited(f"rank {c.rank} of {c.size} (threads), in {format_op(c.origin.last_op)}: "
                              f"rank {self.source} returned from its function without sending the "
                              f"message this rank waits for (tag {self.key[-1]})")
        return None

    def wait(self):
        c, world, start = self.comm, self.comm.world, time.monotonic()
        if c.clock is not None:
            c.clock.pause()
        notice_at, marked = c.notice_after(), False
        try:
            while not self.test():
                with self.cond:
                    while (self.key, self.seq) not in world.box:
                        error = self._problem()
                        if error is not None:
                            raise error
                        if not marked:
                            c.mark_waiting(start)
                            marked = True
                        waited = time.monotonic() - start
                        what = f"a message from rank {self.source} (tag {self.key[-1]})"
                        if waited > notice_at:
                            notice_at = c.still_waiting(what, waited)
                        if waited > c.timeout:
                            raise c.timeout_error(what, waited)
                        self.cond.wait(min(0.25, c.timeout - waited + 1e-3, max(notice_at - waited, 1e-3)))
        finally:
            if marked:
                c.mark_waiting(None)
        if c.clock is not None:
            c.clock.resume(self.arrival)
        return self.result

    def _deliver(self, arr: np.ndarray, had_header: bool, arrival: float = 0.0):
        c = self.comm
        self.arrival = arrival
        if self.out is None:
            self.result = arr
        else:
            if arr.size != self.out.size or (self.header and arr.shape != self.out.shape) or \
                    arr.dtype != self.out.dtype:
                raise MessageMismatch(
                    f"rank {c.rank}: received {arr.dtype}{list(arr.shape)} from rank {self.source} "
                    f"into a buffer of {self.out.dtype}{list(self.out.shape)}")
            self.out[...] = arr.reshape(self.out.shape)
            self.result = self.out
        if self.count:
            c.ledger.count_recv(arr.nbytes)


class ThreadComm(Watched):
    """One rank's end of a group of threads. ``members`` are the world ranks of the group."""

    transport = "threads"

    def __init__(self, world: ThreadWorld, ctx: tuple, members: list[int], rank: int,
                 backend=None, ledger: Ledger | None = None):
        super().__init__(rank, len(members), backend, ledger)
        self.world, self.ctx, self.members = world, ctx, members
        self.world_rank = members[rank]
        self._nsplit = 0
        self.clock = world.clocks[self.world_rank] if world.clocks is not None else None
        self.board, self.board_rank = world.board, self.world_rank

    def note(self, op) -> None:
        self.origin.last_op = op
        self.world.last_ops[self.world_rank] = op

    def ranks_status(self) -> str:
        return "\n".join(f"rank {r} (world rank {w}): {format_op(self.world.last_ops[w])}"
                         + (" [returned]" if w in self.world.finished else "")
                         for r, w in enumerate(self.members))

    def not_arrived(self) -> list[int]:
        ops = self.world.last_ops
        return [r for r, w in enumerate(self.members) if ops[w] != ops[self.world_rank]]

    def _key(self, src: int, dst: int, tag: int):
        return (self.ctx, self.members[src], self.members[dst], tag)

    def isend_buffer(self, buf, dest, tag=0, *, header=False, count=True) -> Request:
        done = arrival = 0.0
        if self.clock is not None:
            done, arrival = self.clock.send(buf.nbytes)  # charged in virtual time, not slept
        elif self.link is not None:
            self.link.pause(buf.nbytes)  # the emulated link is busy for alpha + bytes / bandwidth
        if self.world.failed is not None:
            raise RankAborted(f"rank {self.rank}: rank {self.world.failed} failed; not sending to {dest}")
        key = self._key(self.rank, dest, tag)
        msg = (self.copy_message(buf, dest), header, arrival)  # buffered: the sender may reuse its buffer
        cond = self.world.conds[self.members[dest]]
        with cond:
            seq = self.world.sent.get(key, 0)
            self.world.sent[key] = seq + 1
            self.world.box[(key, seq)] = msg
            queued = self.world.queued.setdefault(key[:-1], {})
            queued[tag] = queued.get(tag, 0) + 1
            cond.notify_all()
        if count:
            self.ledger.count_send(buf.nbytes)
        if header:
            self.ledger.count_header(8 * HEADER_LEN)  # what the MPI transport's header costs
        if self.clock is not None:
            self.clock.resume()  # copying the message is the transport's work, not compute
            return _Sent(self.clock, done)
        return _Done()

    def copy_message(self, buf, dest: int):
        """What lands in rank ``dest``'s mailbox: a copy of ``buf`` (the JAX device transport,
        jaxdev.py, instead moves a device array onto ``dest``'s device)."""
        return np.array(buf, copy=True)

    def irecv_buffer(self, out, source, tag=0, *, header=False, count=True) -> Request:
        key = self._key(source, self.rank, tag)
        with self.world.conds[self.world_rank]:
            seq = self.world.posted.get(key, 0)
            self.world.posted[key] = seq + 1
        return _ThreadRecv(self, source, key, seq, out, header, count)

    def make_channel(self, name: str) -> ThreadComm:
        return ThreadComm(self.world, (*self.ctx, "channel", name), self.members, self.rank,
                          self.backend, self.ledger)

    def split(self, color, key=0):
        infos = self.allgather_obj((color, key))
        self._nsplit += 1
        if color is None or color < 0:
            return None
        group = sorted((k, r) for r, (c, k) in enumerate(infos) if c == color)
        ranks = [r for _, r in group]
        return ThreadComm(self.world, (*self.ctx, "split", self._nsplit, color),
                          [self.members[r] for r in ranks], ranks.index(self.rank),
                          self.backend, Ledger(parent=self.ledger))
