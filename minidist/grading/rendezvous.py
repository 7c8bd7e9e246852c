"""The rendezvous transport: threads where a send completes only when its receive is posted.

The threads transport buffers every message, so a send never blocks and a ring of blocking
send-then-receive "works" -- on MPI with large messages (rendezvous protocol) the same code hangs,
because every rank waits in its send for a neighbour that is itself waiting in its send. The
graders run point-to-point exercises here, so that ring fails as it would on a cluster, and it
fails in a fraction of a second with the cycle of waiting ranks instead of at the watchdog:

    rank 0 waits in send to rank 1 (rank 1 has posted no matching receive)
    rank 1 waits in send to rank 2 ...  -> back to rank 0: a deadlock.

Only payload messages rendezvous (``count=True``); pickled objects and barriers stay eager, as
small messages are on MPI. The collectives' private channels rendezvous too (minidist's own
collectives must pass here: tests/exercises/test_grading.py); ``split`` gives plain threads
communicators.

How a deadlock is seen: each rank, while it waits, records what it waits for (``world.blocked``:
a send to D waits for D to post the receive; a receive from S waits for S's message). Following
"waits for" from a waiting rank back to itself, through ranks whose waits are all still unmet,
twice 0.1 s apart with the same waits, is a cycle no rank in it can break.
"""

from __future__ import annotations

import itertools
import time

from minidist.comm.requests import CommError, RankAborted, RankExited, Request
from minidist.comm.runner import _run_threads
from minidist.comm.transports.threads import ThreadComm, _ThreadRecv

_ids = itertools.count()
CONFIRM_S = 0.1  # a cycle must be seen twice this far apart, with the same waits in it


class Deadlock(CommError):
    """Ranks that wait for each other in a cycle: no message can ever arrive."""


class _Wait:
    """One rank's current wait: on ``peer`` (a group rank of ``comm``), met when ``met()``."""

    def __init__(self, comm, peer: int, what: str, met):
        self.id, self.comm, self.peer, self.what, self.met = next(_ids), comm, peer, what, met


def _cycle(world, me: int):
    """The world ranks of a cycle of unmet waits through ``me``, as (rank, _Wait) pairs, or None."""
    chain, r = [], me
    while True:
        w = world.blocked.get(r)
        if w is None or w.met():
            return None
        chain.append((r, w))
        r = w.comm.members[w.peer]
        if r == me:
            return chain
        if any(r == q for q, _ in chain) or len(chain) > world.size:
            return None  # a cycle not through me: one of its own ranks will report it


def _describe(chain) -> str:
    steps = [f"rank {r} waits in {w.what}" for r, w in chain]
    return ("deadlock: " + "; ".join(steps) + f" -- back to rank {chain[0][0]}. Every rank in this cycle "
            "is blocked in a call that only the next one can complete. On MPI with large messages a send "
            "completes only when the matching receive is posted: exchange with comm.sendrecv (or post "
            "comm.irecv before sending, or let even ranks send first while odd ranks receive)")


class _Waiting:
    """What both request kinds share: register the wait, detect the cycle, honour the timeout."""

    def _wait_until(self, test, peer: int, what: str, problem):
        c, world, start = self.comm, self.comm.world, time.monotonic()
        seen = None
        while not test():
            error = problem()
            if error is not None:
                raise error
            world.blocked[c.world_rank] = self._entry(peer, what)
            chain = _cycle(world, c.world_rank)
            ids = chain and [w.id for _, w in chain]
            if chain and seen == ids:
                raise Deadlock(_describe(chain))
            seen = ids
            waited = time.monotonic() - start
            if waited > c.timeout:
                raise c.timeout_error(what, waited)
            with world.conds[c.world_rank]:
                world.conds[c.world_rank].wait(CONFIRM_S)
        if world.blocked.get(c.world_rank) is getattr(self, "_registered", None):
            world.blocked.pop(c.world_rank, None)

    def _entry(self, peer, what):
        if getattr(self, "_registered", None) is None:
            self._registered = _Wait(self.comm, peer, what, self._met)
        return self._registered


class _RendezvousSend(_Waiting, Request):
    def __init__(self, comm, dest: int, key, seq):
        self.comm, self.dest, self.key, self.seq = comm, dest, key, seq

    def _met(self) -> bool:
        return self.comm.world.posted.get(self.key, 0) > self.seq

    def test(self) -> bool:
        return self._met()

    def problem(self):
        c, world = self.comm, self.comm.world
        if world.failed is not None:
            return RankAborted(f"rank {c.rank}: rank {world.failed} failed while this rank waited to send "
                               f"to rank {self.dest}")
        if c.members[self.dest] in world.finished:
            return RankExited(f"rank {c.rank} of {c.size}: rank {self.dest} returned from its function "
                              f"without receiving this rank's message (tag {self.key[-1]})")
        world.blocked[c.world_rank] = self._entry(self.dest, self._what())
        chain = _cycle(world, c.world_rank)
        return Deadlock(_describe(chain)) if chain else None

    def _what(self):
        d = self.dest
        return f"send to rank {d} (tag {self.key[-1]}; rank {d} has posted no matching receive)"

    def wait(self):
        def problem():  # a failed or departed peer; the cycle itself is checked by _wait_until
            c, world = self.comm, self.comm.world
            gone = world.failed is not None or c.members[self.dest] in world.finished
            return self.problem() if gone else None
        self._wait_until(self.test, self.dest, self._what(), problem)


class _RendezvousRecv(_Waiting, _ThreadRecv):
    def _met(self) -> bool:
        return self.result is not None or (self.key, self.seq) in self.comm.world.box

    def _what(self):
        return f"receive from rank {self.source} (tag {self.key[-1]}; no message sent yet)"

    def problem(self):
        error = super().problem()
        if error is not None or self._met():
            return error
        world = self.comm.world
        world.blocked[self.comm.world_rank] = self._entry(self.source, self._what())
        chain = _cycle(world, self.comm.world_rank)
        return Deadlock(_describe(chain)) if chain else None

    def wait(self):
        def problem():
            with self.cond:
                return None if self._met() else self._problem()
        self._wait_until(self.test, self.source, self._what(), problem)
        return self.result


class RendezvousComm(ThreadComm):
    """A threads communicator whose payload sends complete only when the receiver has posted the
    matching receive. Same interface; use it through :func:`run_rendezvous`."""

    transport = "threads (rendezvous)"

    def __init__(self, world, ctx, members, rank, backend=None, ledger=None):
        super().__init__(world, ctx, members, rank, backend, ledger)
        if not hasattr(world, "blocked"):
            world.blocked = {}  # world rank -> its current _Wait (set by the first rank; dict ops are atomic)

    def isend_buffer(self, buf, dest, tag=0, *, header=False, count=True) -> Request:
        eager = super().isend_buffer(buf, dest, tag, header=header, count=count)
        if not count:
            return eager  # small metadata: eager, as on MPI
        key = self._key(self.rank, dest, tag)
        return _RendezvousSend(self, dest, key, self.world.sent[key] - 1)

    def irecv_buffer(self, out, source, tag=0, *, header=False, count=True) -> Request:
        req = super().irecv_buffer(out, source, tag, header=header, count=count)
        recv = _RendezvousRecv.__new__(_RendezvousRecv)
        recv.__dict__.update(req.__dict__)
        self.world.wake_all()  # a sender waiting for this receive to be posted
        return recv

    def make_channel(self, name: str) -> RendezvousComm:  # collectives' private channels rendezvous too
        return RendezvousComm(self.world, (*self.ctx, "channel", name), self.members, self.rank, self.backend,
                              self.ledger)


def run_rendezvous(fn, ranks: int, *, comm_class=RendezvousComm, **kwargs) -> list:
    """``minidist.comm.run(fn, ranks)`` on rendezvous threads: results by rank; a deadlock raises
    :class:`Deadlock` naming the cycle of waiting ranks. ``comm_class``: a subclass of
    RendezvousComm (rounds.py's counts rounds too)."""
    return _run_threads(fn, ranks, None, kwargs, comm_class=comm_class)
