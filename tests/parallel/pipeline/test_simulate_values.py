"""The simulator's numbers against timelines worked out by hand: a per-message time (`comm_time > 0`)
under rendezvous and under buffered (background) sends, and the two memory counters (M_B, M_W) on
hand-made instruction lists. (The simulator's own file and its other tests belong to the virtual-clock
work; these only read what it reports.)"""

import pytest

from minidist.parallel.pipeline.schedule import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    OptimizerStep,
    gpipe,
)
from minidist.parallel.pipeline.simulate import peak_activations, peak_pending_weights, simulate

F, B, W = Forward, BackwardInput, BackwardWeight


def _starts(result, rank, name):
    return [e["t0"] for e in result.events if e["rank"] == rank and e["name"] == name]


def test_gpipe_with_comm_time_under_rendezvous_by_hand():
    """p = 2, m = 2, F = 1, whole backward 2, each message 0.5, rendezvous: a send and its receive
    both complete at max(posted) + 0.5.
    stage 0: F0 [0, 1], send 0 meets the posted receive: 1.5; F1 [1.5, 2.5], send 1 at 2.5 + .5 = 3;
    stage 1: F0 [1.5, 2.5], F1 [3, 4], B0 [4, 6], its send meets stage 0's receive (posted at 3) at
    6.5, B1 [6.5, 8.5], send at 9; stage 0: B0 [6.5, 8.5], B1 [9, 11]."""
    r = simulate(gpipe(2, 2), fwd_time=1, bwd_time=2, comm_time=0.5, buffered_sends=False)
    assert _starts(r, 0, "Forward") == [0, 1.5] and _starts(r, 0, "Backward") == [6.5, 9]
    assert _starts(r, 1, "Forward") == [1.5, 3] and _starts(r, 1, "Backward") == [4, 6.5]
    assert r.makespan == 11


def test_gpipe_with_comm_time_and_buffered_sends_by_hand():
    """The same with buffered sends, under the rule `simulate` documents (the virtual clock's): a send
    completes when posted, and its message is in flight from then on, so its receive ends at
    max(posted, sent + 0.5) -- a receiver that posts after the message arrived does not pay again.
    stage 0: F0 [0, 1], F1 [1, 2] (no wait for stage 1); stage 1: receive 0 at 1 + .5, F0 [1.5, 2.5],
    receive 1 at max(2.5, 2 + .5) = 2.5, F1 [2.5, 3.5], B0 [3.5, 5.5], B1 [5.5, 7.5]; stage 0: receive
    at 5.5 + .5 = 6, B0 [6, 8], receive at max(8, 7.5 + .5) = 8, B1 [8, 10]."""
    r = simulate(gpipe(2, 2), fwd_time=1, bwd_time=2, comm_time=0.5, buffered_sends=True)
    assert _starts(r, 0, "Forward") == [0, 1] and _starts(r, 0, "Backward") == [6, 8]
    assert _starts(r, 1, "Forward") == [1.5, 2.5] and _starts(r, 1, "Backward") == [3.5, 5.5]
    assert max(e["t1"] for e in r.events if e["rank"] == 1) == 7.5
    assert r.makespan == 10


def test_buffered_sends_without_comm_time_are_the_textbook_step():
    r = simulate(gpipe(2, 2), fwd_time=1, bwd_time=2, buffered_sends=True)
    assert _starts(r, 1, "Forward") == [1, 2] and _starts(r, 0, "Backward") == [5, 7]
    assert r.makespan == (2 + 2 - 1) * 3


@pytest.mark.parametrize("c", [0.25, 1.0])
def test_each_hop_of_a_chain_pays_the_message_time_once(c):
    """p = 4, m = 1, F = 1, B = 2: the microbatch's path crosses 3 links forward and 3 back, each paying
    c, under either kind of send: (F + B)·p + 6c."""
    for buffered in (False, True):
        assert simulate(gpipe(4, 1), 1, 2, comm_time=c, buffered_sends=buffered).makespan == 12 + 6 * c


# (a stage's instruction list, most (mb, chunk) between F and B, most between B and W), by hand
COUNTERS = [
    ([F(0), F(1), B(0), F(2), W(0), B(1), B(2), W(1), W(2)], 2, 2),
    ([F(0), B(0), W(0), F(1), B(1), W(1)], 1, 1),
    ([F(0), F(1), F(2), Backward(0), Backward(1), Backward(2), OptimizerStep()], 3, 0),
    ([F(0), F(1), B(0), B(1), W(1), W(0)], 2, 2),
    ([F(0, 0), F(0, 1), B(0, 1), F(1, 0), B(0, 0), W(0, 1), W(0, 0), B(1, 0), W(1, 0)], 2, 2),
    ([], 0, 0),
]


@pytest.mark.parametrize("ops, held, pending", COUNTERS)
def test_memory_counters_by_hand(ops, held, pending):
    assert peak_activations(ops) == held
    assert peak_pending_weights(ops) == pending
