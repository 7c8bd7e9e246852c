"""The transport interface is enough: a toy transport written here in one short class (a dict of
queues shared by threads, waits through ``poll``) runs every collective and the mismatch checks,
with nothing of minidist's changed -- what a student adding a transport would write."""

import collections
import threading

import numpy as np
import pytest

from minidist.comm import CollectiveMismatch, Request, all_gather, all_reduce, broadcast
from minidist.comm.waiting import poll
from minidist.comm.watchdog import Watched


class QueueComm(Watched):
    transport = "queues"

    def __init__(self, box, ctx, members, rank):
        super().__init__(rank, len(members))
        self.box, self.ctx, self.members = box, ctx, members  # box: (ctx, src, dst, tag) -> deque

    def isend_buffer(self, buf, dest, tag=0, *, header=False, count=True):
        with self.box.lock:
            self.box[(self.ctx, self.members[self.rank], self.members[dest], tag)].append(np.array(buf))
        if count:
            self.ledger.count_send(buf.nbytes)
        return Done()

    def irecv_buffer(self, out, source, tag=0, *, header=False, count=True):
        return Recv(self, (self.ctx, self.members[source], self.members[self.rank], tag), out, count)

    def make_channel(self, name):
        return QueueComm(self.box, (*self.ctx, name), self.members, self.rank)

    def split(self, color, key=0):
        infos = self.allgather_obj((color, key))
        ranks = [r for _, r in sorted((k, r) for r, (c, k) in enumerate(infos) if c == color)]
        return None if color is None else QueueComm(self.box, (*self.ctx, "split", color),
                                                    [self.members[r] for r in ranks], ranks.index(self.rank))

    def check_wait(self, key):  # the strict twin's check: the peer's queued message of another call
        if self.strict:
            for (ctx, src, dst, tag), q in list(self.box.items()):
                if q and (ctx, src, dst) == key[:3] and tag != key[3]:
                    from minidist.comm.debug import stamp_mismatch

                    return stamp_mismatch(self, self.members.index(src), key[3], tag)
        return None


class Done(Request):
    def test(self):
        return True

    def wait(self):
        return None


class Recv(Request):
    def __init__(self, comm, key, out, count):
        self.comm, self.key, self.out, self.count, self.got = comm, key, out, count, None

    def test(self):
        if self.got is None:
            with self.comm.box.lock:
                q = self.comm.box[self.key]
                self.got = q.popleft() if q else None
        return self.got is not None

    def wait(self):
        poll(self.test, self.comm, f"a message {self.key}", lambda: self.comm.check_wait(self.key))
        if self.count:
            self.comm.ledger.count_recv(self.got.nbytes)
        if self.out is None:
            return self.got
        if self.got.nbytes != self.out.nbytes:
            raise ValueError(f"rank {self.comm.rank}: {self.got.nbytes} bytes into {self.out.nbytes}")
        self.out[...] = self.got.reshape(self.out.shape)
        return self.out


class Box(collections.defaultdict):
    """The shared mailboxes: (context, source, destination, tag) -> messages in order, and a lock."""

    def __init__(self):
        super().__init__(collections.deque)
        self.lock = threading.Lock()


def on_queues(fn, p):
    box, out, errors = Box(), [None] * p, []

    def body(r):
        try:
            out[r] = fn(QueueComm(box, (), list(range(p)), r))
        except Exception as e:
            errors.append(e)
    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(p)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return out


@pytest.mark.parametrize("algo", ["ring", "recursive_doubling", "halving_doubling", "two_shot", "tree",
                                  "naive"])
def test_every_collective_runs_on_a_transport_written_in_one_class(algo):
    p = 5
    xs = [np.arange(7.0) * (r + 1) for r in range(p)]
    out = on_queues(lambda c: (all_reduce(c, xs[c.rank], algorithm=algo), all_gather(c, xs[c.rank][:2]),
                               broadcast(c, xs[2] if c.rank == 2 else None, root=2),
                               all_reduce(c.split(c.rank % 2), np.ones(2), algorithm=algo)), p)
    for r, (s, g, b, sub) in enumerate(out):
        np.testing.assert_array_equal(s, np.arange(7.0) * 15)  # 1 + 2 + ... + 5
        np.testing.assert_array_equal(g, np.concatenate([x[:2] for x in xs]))
        np.testing.assert_array_equal(b, xs[2])
        np.testing.assert_array_equal(sub, np.full(2, 3.0 if r % 2 == 0 else 2.0))


def test_the_stamps_catch_a_mismatch_on_it_too():
    with pytest.raises(CollectiveMismatch, match="dtype float(32|64)"):
        on_queues(lambda c: all_reduce(c, np.ones(4, np.float32 if c.rank else np.float64),
                                       algorithm="ring"), 2)
