"""The fabric: collectives over any members, a revoked communicator releases a blocked receive, a lost
member is named at once -- on threads and over TCP between sockets of one process."""

import threading
import time

import numpy as np
import pytest

from minidist.comm import ring_all_reduce, two_shot_all_reduce
from minidist.comm.requests import RankExited
from minidist.resilience.live.errors import Revoked, Unreachable
from minidist.resilience.live.fabric import LiveWorld, comm_over
from minidist.resilience.live.sockets import SocketComm, SocketWorld


def _threads(n, fn):
    """fn(member) on n threads; returns the results (an exception is returned, not raised)."""
    out = [None] * n

    def body(i):
        try:
            out[i] = fn(i)
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            out[i] = e
    ts = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(20)
    return out


def _thread_fabric(n):
    world = LiveWorld()
    members = [world.add_member() for _ in range(n)]
    return world, members, (lambda m, ms, ctx: comm_over(world, ms, m, ctx))


def _socket_fabric(n):
    worlds = [SocketWorld() for _ in range(n)]
    for i, w in enumerate(worlds):
        w.member = 100 + i
    book = {w.member: w.address for w in worlds}
    for w in worlds:
        w.addresses.update(book)
    by = {w.member: w for w in worlds}
    return worlds, [w.member for w in worlds], (
        lambda m, ms, ctx: comm_over(by[m], ms, m, ctx, cls=SocketComm))


@pytest.mark.parametrize("kind", ["threads", "tcp"])
def test_collectives_run_unchanged_over_any_list_of_members(kind):
    fabric = _thread_fabric(4) if kind == "threads" else _socket_fabric(4)
    _, members, make = fabric
    chosen = [members[3], members[0], members[2]]  # any members, in any order
    xs = {m: np.random.default_rng(m).standard_normal(37) for m in chosen}
    want = (xs[chosen[0]] + xs[chosen[1]]) + xs[chosen[2]]   # two-shot adds up in rank order

    def fn(i):
        m = chosen[i]
        comm = make(m, chosen, ("test", 1))
        return two_shot_all_reduce(comm, xs[m]), ring_all_reduce(comm, xs[m])
    for two_shot, ring in _threads(3, fn):
        assert np.array_equal(two_shot, want)          # bit for bit: the order is the ranks'
        np.testing.assert_allclose(ring, want, rtol=1e-12)


@pytest.mark.parametrize("kind", ["threads", "tcp"])
def test_revoking_a_communicator_releases_a_blocked_receive_and_refuses_later_ones(kind):
    fabric = _thread_fabric(2) if kind == "threads" else _socket_fabric(2)
    worlds, members, make = fabric
    comm = make(members[0], members, ("q", 3, 0, 0))
    other = make(members[0], members, ("q", 3, 1, 0))   # the next attempt: not revoked
    got = {}

    def waiter():
        t0 = time.monotonic()
        try:
            comm.recv(1)
        except Revoked as e:
            got["error"], got["after"] = e, time.monotonic() - t0
    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    time.sleep(0.2)
    for w in ([worlds] if kind == "threads" else worlds):
        w.revoke(("q", 3, 0))
    t.join(5)
    assert "was revoked (a member of it failed)" in str(got["error"]) and got["after"] < 2
    with pytest.raises(Revoked):
        comm.send(np.zeros(2), 1)
    sender = make(members[1], members, ("q", 3, 1, 0))
    sender.send(np.arange(3.0), 0)
    assert np.array_equal(other.recv(1), np.arange(3.0))


def test_a_receive_from_a_lost_member_raises_at_once_naming_it():
    world, members, make = _thread_fabric(2)
    comm = make(members[0], members, ("g", 0, 0))
    threading.Timer(0.2, lambda: world.lose(members[1], "killed (kill:group=0,step=3)")).start()
    t0 = time.monotonic()
    with pytest.raises(RankExited, match=r"member 1\) was lost \(killed \(kill:group=0,step=3\)\)"):
        comm.recv(1)
    assert time.monotonic() - t0 < 2


def test_a_closed_socket_is_a_lost_member_and_a_refused_address_is_unreachable():
    worlds, members, make = _socket_fabric(3)
    a = make(members[0], members, ("x",))
    b = make(members[1], members, ("x",))
    b.send(np.ones(4), 0)
    assert np.array_equal(a.recv(1), np.ones(4))
    worlds[1].close()
    for s, _ in worlds[0].out.values():
        s.close()
    worlds[1].out.clear()
    with pytest.raises(RankExited):
        a.recv(1)                     # its connection to us ended: lost
    worlds[2].refuse()
    with pytest.raises(Unreachable, match="cannot reach member 102"):
        a.send(np.ones(1), 2)


def test_comm_over_refuses_a_member_not_in_the_list():
    world, members, _ = _thread_fabric(2)
    with pytest.raises(ValueError, match="member 7 is not one of the communicator's members"):
        comm_over(world, members, 7, ("x",))
