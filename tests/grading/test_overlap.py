"""The overlap log (minidist/grading/overlap.py): transfers, multiplies and their order, read per rank."""

import numpy as np

from minidist.grading import run_guarded
from minidist.grading.overlap import EventComm, logged, logging, unhidden


def test_unhidden_lists_transfers_with_no_multiply_inside():
    events = [("start", 1, "send to rank 1"), ("multiply", -1, ""), ("finish", 1, ""),
              ("start", 2, "receive from rank 0"), ("finish", 2, ""), ("multiply", -1, ""),
              ("start", 3, "send to rank 2"), ("finish", 3, "")]
    assert unhidden(events) == ["receive from rank 0", "send to rank 2"]
    assert unhidden([]) == []


def test_every_product_form_is_logged_on_a_logged_operand():
    w = logged(np.eye(3))
    x = np.ones((2, 3))

    @logging
    def body(comm):
        x @ w
        np.matmul(x, w)
        np.dot(x, w)
        np.einsum("ij,jk->ik", x, w)
        np.tensordot(x, w, 1)
        w + w  # not a product
        return None

    [(_, events)] = run_guarded(body, 1, comm_class=EventComm)
    assert [k for k, _, _ in events] == ["multiply"] * 5


def test_a_hop_started_before_the_multiply_and_waited_after_is_hidden():
    @logging
    def body(comm):
        w = logged(np.eye(2))
        r, p = comm.rank, comm.size
        recv, send = comm.irecv((r - 1) % p), comm.isend(np.ones(2), (r + 1) % p)
        np.ones((1, 2)) @ w
        send.wait()
        recv.wait()
        late_recv, late_send = comm.irecv((r - 1) % p), comm.isend(np.ones(2), (r + 1) % p)
        late_send.wait()
        late_recv.wait()
        np.ones((1, 2)) @ w
        return None

    for r, (_, events) in enumerate(run_guarded(body, 2, comm_class=EventComm)):
        other = 1 - r
        assert sorted(unhidden(events)) == [f"receive from rank {other}", f"send to rank {other}"]
