"""Counting communication rounds: the latency a collective pays, read off the messages it sent.

A binomial-tree broadcast needs ceil(log2 p) rounds; the same tree with each rank sending to its
nearest child first needs k(k+1)/2 at p = 2**k (6 at p = 8), yet sends the same messages and
bytes, so the ledger cannot tell them apart. The graders count rounds instead, in the
one-port model of the alpha-beta cost: in one round a rank sends at most one message and receives
at most one (``sendrecv`` is one round: both at once), and a message received in round t can be
forwarded in round t + 1 at the earliest.

Every payload message carries a stamp, the round it leaves in, kept beside the transport's mailbox
(the stamp travels in no message, so the ledger's bytes are unchanged). Per rank:

* send: round ``t = max(known + 1, last_send + 1)``, where ``known`` is the latest round whose
  data this rank has received (what it sends may depend on it);
* receive of a message stamped t: round ``a = max(t, last_recv + 1)``; ``known = max(known, a)``.

A rank's rounds are ``max(known, last_send)``; a collective's are the maximum over ranks. A ring
all-reduce of sendrecv steps takes 2(p-1); a ring of even-sends-first / odd-receives-first steps
takes twice that, which is what it costs when sends wait for their receives.
"""

from __future__ import annotations

from minidist.comm.requests import Request
from minidist.grading.rendezvous import RendezvousComm


class _Clock:
    """One rank's round bookkeeping (shared by the rank's private channels: same ranks, same port)."""

    __slots__ = ("known", "last_send", "last_recv")

    def __init__(self):
        self.known = self.last_send = self.last_recv = 0

    def rounds(self) -> int:
        return max(self.known, self.last_send)


class _CountedRecv(Request):
    """The transport's receive; when it completes, the receiver's clock takes the message's stamp."""

    def __init__(self, req, comm, key, seq):
        self.req, self.comm, self.key, self.seq, self.done = req, comm, key, seq, False

    def _arrived(self):
        if not self.done:
            self.done = True
            clock = self.comm.round_clock
            stamp = self.comm.world.stamps.pop((self.key, self.seq), 0)
            clock.last_recv = max(stamp, clock.last_recv + 1)
            clock.known = max(clock.known, clock.last_recv)

    def test(self) -> bool:
        ok = self.req.test()
        if ok:
            self._arrived()
        return ok

    def problem(self):
        return self.req.problem()

    def wait(self):
        out = self.req.wait()
        self._arrived()
        return out


class RoundsComm(RendezvousComm):
    """The rendezvous communicator that also counts rounds (see the module docstring):
    ``comm.rounds()`` is this rank's count so far."""

    def __init__(self, world, ctx, members, rank, backend=None, ledger=None):
        super().__init__(world, ctx, members, rank, backend, ledger)
        if not hasattr(world, "stamps"):
            world.stamps, world.round_clocks = {}, {}  # (key, seq) -> round sent; world rank -> _Clock
        self.round_clock = world.round_clocks.setdefault(self.world_rank, _Clock())

    def rounds(self) -> int:
        return self.round_clock.rounds()

    def isend_buffer(self, buf, dest, tag=0, *, header=False, count=True) -> Request:
        if count:
            key = self._key(self.rank, dest, tag)  # only this rank sends on key: seq is the next one
            c = self.round_clock
            c.last_send = max(c.known + 1, c.last_send + 1)
            self.world.stamps[(key, self.world.sent.get(key, 0))] = c.last_send
        return super().isend_buffer(buf, dest, tag, header=header, count=count)

    def irecv_buffer(self, out, source, tag=0, *, header=False, count=True) -> Request:
        req = super().irecv_buffer(out, source, tag, header=header, count=count)
        return _CountedRecv(req, self, req.key, req.seq) if count else req

    def make_channel(self, name: str) -> RoundsComm:
        return RoundsComm(self.world, (*self.ctx, "channel", name), self.members, self.rank, self.backend,
                          self.ledger)
