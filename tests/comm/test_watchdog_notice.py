"""The watchdog's "still waiting" line comes for a hang, not for work in flight (issue 42).

A wait is explained while another rank of the job works (rank 0 computing a serial twin): each
transport keeps a board of which ranks are blocked in a wait (threads: a list, MPI on one node:
shared memory), and ``Watched.still_waiting`` prints the line only when every rank waits -- or, for
work that outlasts ``BUSY_NOTICE`` of the timeout, then too -- and the timeout still raises.
"""

import threading
import time

import numpy as np
import pytest

from minidist.comm import CommTimeout, ThreadComm, run, watchdog
from minidist.comm.transports.threads import ThreadWorld
from minidist.comm.waiting import mark_background_thread


def _rank0_of(board, timeout=100.0):
    world = ThreadWorld(len(board))
    comm = ThreadComm(world, (), list(range(len(board))), 0)
    world.board[:] = board
    comm.timeout = timeout
    return comm


def test_no_line_while_another_rank_works_until_its_share_of_the_timeout(capsys):
    comm = _rank0_of([5.0, 0.0, 5.0])                # rank 1 works, rank 2 waits like rank 0
    assert comm.working_ranks() == [1]
    assert comm.still_waiting("a message from rank 1", 10.0) == 10.5   # look again in 0.5 s
    assert comm.still_waiting("a message from rank 1", 74.9) == 75.0   # never past 0.75 x 100 s
    assert capsys.readouterr().err == ""
    assert comm.still_waiting("a message from rank 1", 75.0) == float("inf")
    err = capsys.readouterr().err
    assert "still waiting after 75 s" in err and "ranks working: [1]" in err, err


def test_when_every_rank_waits_or_has_returned_the_line_comes_at_once(capsys):
    comm = _rank0_of([5.0, -1.0, 7.0])               # rank 1 returned, rank 2 waits: a hang
    assert comm.working_ranks() == []
    assert comm.still_waiting("a message from rank 2", 10.0) == float("inf")
    assert "still waiting after 10 s in start for a message from rank 2; every rank is waiting" \
        in capsys.readouterr().err


def test_without_a_board_the_line_comes_as_before(capsys):
    comm = _rank0_of([0.0, 0.0])
    comm.board = None                                # MPI across nodes: the others can't be seen
    assert comm.working_ranks() is None
    assert comm.still_waiting("x", 10.0) == float("inf")
    err = capsys.readouterr().err
    assert "still waiting after 10 s" in err and "working" not in err and "every rank" not in err


def test_a_background_threads_wait_does_not_mark_the_rank_blocked():
    comm = _rank0_of([0.0, 0.0])
    comm.mark_waiting(3.0)
    assert comm.world.board[0] == 3.0
    comm.mark_waiting(None)

    def worker():
        mark_background_thread()
        comm.mark_waiting(4.0)                       # DDP's bucket wait while backward computes

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert comm.world.board[0] == 0.0


@pytest.fixture
def short_timeout(monkeypatch):
    monkeypatch.setenv("MINIDIST_TIMEOUT", "4")      # the line: at 2 s for a hang, at 3 s while one works
    assert watchdog.BUSY_NOTICE * 4 == 3.0


def test_a_long_serial_twin_on_rank_0_prints_nothing(short_timeout, capsys):
    def body(comm):
        if comm.rank == 0:
            time.sleep(2.5)                          # past the hang's 2 s, before the 3 s line
        return comm.bcast_obj(comm.rank, root=0)

    assert run(body, ranks=3) == [0, 0, 0]
    assert "still waiting" not in capsys.readouterr().err


def test_a_real_hang_still_warns_then_times_out(short_timeout, capsys):
    def body(comm):                                  # each waits for a message the other never sends
        comm.recv(1 - comm.rank, tag=9)

    t = time.monotonic()
    with pytest.raises(CommTimeout, match="waited 4"):
        run(body, ranks=2)
    assert time.monotonic() - t < 10
    err = capsys.readouterr().err
    assert "still waiting after 2 s in recv from" in err and "every rank is waiting" in err, err


def test_a_rank_waiting_through_poll_is_marked_on_the_board_meanwhile():
    """wait_all (the MPI transport's and shm's ``poll``) marks the rank past its spin phase, and
    unmarks it when the wait ends."""
    seen = []

    def body(comm):
        if comm.rank == 0:
            time.sleep(0.3)
            seen.append(list(comm.world.board))      # rank 1 is blocked in wait_all by now
            comm.send(np.ones(1), 1)
        else:
            comm.wait_all([comm.irecv(0)], "a message from rank 0")
            seen.append(comm.world.board[1])
        return comm.rank

    run(body, ranks=2)
    assert seen[0][0] == 0.0 and seen[0][1] > 0 and seen[1] == 0.0


def test_a_rank_waiting_for_its_async_collective_is_marked_blocked():
    """DDP's wait_gradients waits on a Handle, not in poll: that wait marks the rank too."""
    from minidist.comm import all_reduce_async

    seen = []

    def body(comm):
        if comm.rank == 0:
            all_reduce_async(comm, np.ones(4)).wait()      # rank 1 joins late
            seen.append(comm.world.board[0])
        else:
            time.sleep(0.6)
            seen.append(comm.world.board[0])                # rank 0 is blocked in Handle.wait by now
            all_reduce_async(comm, np.ones(4)).wait()
        return comm.rank

    run(body, ranks=2)
    assert seen[0] > 0 and seen[1] == 0.0, seen
