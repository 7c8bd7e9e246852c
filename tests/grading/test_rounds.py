"""Round counting (minidist/grading/rounds.py) against counts worked out by hand in the one-port model."""

import numpy as np
import pytest

import minidist.comm as C
from minidist.grading import allreduce as G
from minidist.grading.rendezvous import run_rendezvous
from minidist.grading.rounds import RoundsComm


def rounds_of(fn, p):
    """Every rank's round count after fn(comm) on p rendezvous ranks that count rounds."""
    def body(comm):
        fn(comm)
        return comm.rounds()
    return run_rendezvous(body, p, comm_class=RoundsComm)


def test_a_chain_takes_one_round_per_hop():
    def chain(comm):  # 0 -> 1 -> 2 -> 3: rank r holds the data after round r
        x = np.ones(2) if comm.rank == 0 else comm.recv(comm.rank - 1)
        if comm.rank + 1 < comm.size:
            comm.send(x, comm.rank + 1)
    assert rounds_of(chain, 4) == [1, 2, 3, 3]


def test_sendrecv_is_one_round_and_a_rank_sends_one_message_a_round():
    def body(comm):
        p, r = comm.size, comm.rank
        comm.sendrecv(np.ones(1), (r + 1) % p, (r - 1) % p)      # round 1 on every rank
        if r == 0:
            for d in range(1, p):                                # rounds 2, 3, 4: one port
                comm.send(np.ones(1), d)
        else:
            comm.recv(0)
    assert rounds_of(body, 4) == [4, 2, 3, 4]


@pytest.mark.parametrize("p", [1, 2, 3, 5, 8])
def test_a_ring_all_reduce_takes_2_p_minus_1_rounds(p):
    xs = [np.arange(7.0) + r for r in range(p)]
    for ring in (C.ring_all_reduce, G._ring_next_chunk, G._ring_leftwards):
        assert rounds_of(lambda c, ring=ring: ring(c, xs[c.rank]), p) == [2 * (p - 1)] * p


@pytest.mark.parametrize("p", range(1, 9))
def test_a_binomial_broadcast_takes_ceil_log2_p_rounds_farthest_child_first(p):
    want = int(np.ceil(np.log2(p)))
    x = np.arange(3.0)
    for root in {0, p - 1}:
        got = rounds_of(lambda c, root=root: G._tree_broadcast(c, x if c.rank == root else None, root), p)
        assert max(got) == want


@pytest.mark.parametrize("k", [1, 2, 3])
def test_nearest_child_first_takes_a_triangle_number_of_rounds(k):
    """Root: children 1, 2, 4 in rounds 1, 2, 3; the subtree under 2**j starts in round j+1 and its
    own deepest path adds j more: rank 2**k - 1 is reached in 1 + 2 + ... + k = k(k+1)/2."""
    x = np.arange(3.0)
    got = rounds_of(lambda c: G._tree_broadcast_nearest_first(c, x if c.rank == 0 else None), 2 ** k)
    assert max(got) == k * (k + 1) // 2


def test_the_ledger_bytes_are_the_same_with_and_without_round_counting():
    from minidist.comm import measure

    def body(comm):
        with measure(comm) as m:
            C.ring_all_reduce(comm, np.arange(10.0))
        return m.bytes_sent, m.messages
    assert run_rendezvous(body, 3, comm_class=RoundsComm) == run_rendezvous(body, 3)


def test_two_messages_received_by_one_rank_take_two_rounds():
    """One port: rank 0 receives from ranks 1 and 2, both sent in round 1 -- it takes them in rounds 1
    and 2 (a counter that let one round take two receives would say 1)."""
    def body(comm):
        if comm.rank == 0:
            comm.recv(1)
            comm.recv(2)
        elif comm.rank in (1, 2):
            comm.send(np.ones(1), 0)
    assert rounds_of(body, 3) == [2, 1, 1]


def test_a_forward_waits_for_the_round_its_data_arrived_in():
    """Rank 1 receives in round 2 (rank 0 sent to 2 first) and only then forwards: round 3."""
    def body(comm):
        if comm.rank == 0:
            comm.send(np.ones(1), 2)
            comm.send(np.ones(1), 1)
        elif comm.rank == 1:
            x = comm.recv(0)
            comm.send(x, 2)
        else:
            comm.recv(0)
            comm.recv(1)
    assert rounds_of(body, 3) == [2, 3, 3]
