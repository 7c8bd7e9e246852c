"""The fabric: a transport whose members may fail, leave and join, and whose communicators can be revoked.

A member is one rank of the live job, named by an id that is never reused (a replacement gets a new
one). Any list of members makes a communicator (``comm_over``), with a context of its own: the
replica group's, or one step's quorum at one position in the group. Collectives run on it unchanged.

Two things a fixed world lacks:

* **a member is lost** (``lose``): a receive from it raises ``RankExited`` at once, naming why;
* **a communicator is revoked** (``revoke(ctx)``, ULFM's ``MPIX_Comm_revoke``): every pending and
  later operation on it, on every member, raises ``Revoked`` -- so the survivors of a failed
  collective stop waiting for each other and can redo it on a new communicator.

``LiveWorld``/``LiveComm`` are the threads transport's (one process, one mailbox per member);
``sockets.py`` subclasses them for processes over TCP.
"""

from __future__ import annotations

import threading
import time

from minidist.comm.ledger import Ledger
from minidist.comm.requests import RankExited
from minidist.comm.transports.threads import ThreadComm, ThreadWorld, _ThreadRecv
from minidist.resilience.live.errors import Revoked, Unreachable


class LiveWorld(ThreadWorld):
    """The shared state of a live job's members on the threads transport: it grows as members join."""

    def __init__(self):
        super().__init__(0)
        self.clocks = None
        self.revoked: set = set()     # contexts no operation may use any more
        self.lost: dict = {}          # member -> why it was lost
        self.unreachable: set = set()  # members no peer can connect to (a fault)
        self.lock = threading.Lock()

    def add_member(self) -> int:
        """A new member's id (the next world rank)."""
        with self.lock:
            self.conds.append(threading.Condition())
            self.last_ops.append("joined")
            if self.board is not None:
                self.board.append(0.0)  # the watchdog's: working
            self.size += 1
            return self.size - 1

    def lose(self, member: int, why: str) -> None:
        """Member ``member`` is gone: receives from it raise at once."""
        self.lost.setdefault(member, why)
        self.finished.add(member)
        if self.board is not None and member < len(self.board):
            self.board[member] = -1.0  # the watchdog's: no longer a rank to wait for
        self.wake_all()

    def revoke(self, ctx: tuple) -> None:
        """Every operation on a communicator whose context starts with ``ctx`` raises ``Revoked``."""
        self.revoked.add(tuple(ctx))
        self.wake_all()

    def is_revoked(self, ctx: tuple) -> bool:
        return any(ctx[:i] in self.revoked for i in range(1, len(ctx) + 1))


class _LiveRecv(_ThreadRecv):
    def _problem(self):
        c, src = self.comm, self.key[1]
        if c.world.is_revoked(self.key[0]):
            return c.revoked_error(f"waited for a message from rank {self.source}")
        if src in c.world.lost:
            return RankExited(f"rank {c.rank} of {c.size} (member {c.world_rank}, {c.describe()}): rank "
                              f"{self.source} (member {src}) was lost ({c.world.lost[src]}) while this rank "
                              f"waited for a message from it")
        return super()._problem()


class LiveComm(ThreadComm):
    """A communicator over members of a ``LiveWorld`` (``members``: their ids, in rank order)."""

    def describe(self) -> str:
        return "/".join(str(c) for c in self.ctx[:4])

    def revoked_error(self, what: str) -> Revoked:
        return Revoked(f"rank {self.rank} of {self.size} (member {self.world_rank}): the communicator "
                       f"{self.describe()} was revoked (a member of it failed) while this rank {what}")

    def _check(self, what: str) -> None:
        if self.world.is_revoked(self.ctx):
            raise self.revoked_error(what)

    def isend_buffer(self, buf, dest, tag=0, *, header=False, count=True):
        self._check(f"sent to rank {dest}")
        if self.members[dest] in self.world.unreachable:
            raise Unreachable(f"member {self.world_rank} cannot reach member {self.members[dest]} (rank "
                              f"{dest} of {self.describe()})")
        return super().isend_buffer(buf, dest, tag, header=header, count=count)

    def irecv_buffer(self, out, source, tag=0, *, header=False, count=True):
        self._check(f"posted a receive from rank {source}")
        key = self._key(source, self.rank, tag)
        with self.world.conds[self.world_rank]:
            seq = self.world.posted.get(key, 0)
            self.world.posted[key] = seq + 1
        return _LiveRecv(self, source, key, seq, out, header, count)

    def wait_all(self, requests: list, what: str) -> None:
        """Wait for every request, on this member's mailbox condition (a message, a lost member or a
        revocation wakes it): a failure is final here, so it raises at once -- the MPI transport's
        grace for a message still arriving (waiting.py) does not apply to a mailbox."""
        cond, start = self.world.conds[self.world_rank], time.monotonic()
        while True:
            with cond:
                if all([q.test() for q in requests]):
                    break
                error = next((e for q in requests if not q.test() and (e := q.problem()) is not None), None)
                if error is not None:
                    raise error
                if time.monotonic() - start > self.timeout:
                    raise self.timeout_error(what, time.monotonic() - start)
                cond.wait(0.05)
        for q in requests:
            q.wait()

    def make_channel(self, name: str) -> LiveComm:
        return type(self)(self.world, (*self.ctx, "channel", name), self.members, self.rank, self.backend,
                          self.ledger)

    def split(self, color, key=0):
        infos = self.allgather_obj((color, key))
        self._nsplit += 1
        if color is None or color < 0:
            return None
        ranks = [r for _, r in sorted((k, r) for r, (c, k) in enumerate(infos) if c == color)]
        return type(self)(self.world, (*self.ctx, "split", self._nsplit, color),
                          [self.members[r] for r in ranks], ranks.index(self.rank), self.backend,
                          Ledger(parent=self.ledger))


def comm_over(world: LiveWorld, members: list[int], me: int, ctx: tuple, backend=None,
              ledger: Ledger | None = None, cls=LiveComm) -> LiveComm:
    """Member ``me``'s end of a communicator over ``members`` (rank i = members[i]) named ``ctx``."""
    if me not in members:
        raise ValueError(f"member {me} is not one of the communicator's members {members}")
    return cls(world, tuple(ctx), list(members), members.index(me), backend, ledger)
