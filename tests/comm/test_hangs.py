"""No silent hangs: debug mode catches mismatched collectives; the watchdog names stuck ranks."""

import time

import numpy as np
import pytest

from minidist.comm import (
    CollectiveMismatch,
    CommTimeout,
    all_gather,
    all_reduce,
    broadcast,
    run,
)


def test_mismatched_collectives_raise_on_every_rank(monkeypatch):
    monkeypatch.setenv("MINIDIST_DEBUG", "1")
    monkeypatch.setenv("MINIDIST_TIMEOUT", "5")
    errors = {}

    def body(comm):
        all_reduce(comm, np.ones(3))  # agreeing call: fine
        try:
            if comm.rank == 1:
                broadcast(comm, np.ones(3))
            else:
                all_reduce(comm, np.ones(3 if comm.rank else 4), algorithm="ring")
        except CollectiveMismatch as e:
            errors[comm.rank] = str(e)

    run(body, ranks=3)
    assert sorted(errors) == [0, 1, 2]
    msg = errors[0]
    assert "rank 1: collective=broadcast" in msg and "rank 0: collective=ring_all_reduce" in msg
    assert "shape=(4,)" in msg and "seq=2" in msg


def test_debug_mode_catches_shape_mismatch_before_sending(monkeypatch):
    monkeypatch.setenv("MINIDIST_DEBUG", "1")
    with pytest.raises(CollectiveMismatch, match="differing: shape"):
        run(lambda comm: all_reduce(comm, np.ones(2 + comm.rank)), ranks=2)


def test_watchdog_names_waiting_ranks_and_last_operations(monkeypatch):
    monkeypatch.setenv("MINIDIST_TIMEOUT", "1")

    def body(comm):
        if comm.rank == 0:
            all_gather(comm, np.ones(2))    # rank 1 never joins
        else:
            comm.recv(0, tag=9)            # ... it waits for a message that never comes

    t = time.monotonic()
    with pytest.raises(CommTimeout) as info:
        run(body, ranks=2)
    assert time.monotonic() - t < 10
    msg = str(info.value)
    assert "watchdog" in msg and "MINIDIST_TIMEOUT" in msg
    assert "rank 0 (world rank 0): all_gather #1" in msg and "rank 1 (world rank 1): recv from 0 tag 9" in msg


@pytest.mark.parametrize("p", [4, 8])
def test_auto_chooses_one_algorithm_when_only_some_hosts_are_crowded(p, monkeypatch):
    """Multi-host with uneven slots: ``crowded()`` is True on rank 0's host only. For 40 kB at p = 4
    or 8 the model would pick recursive doubling there and two-shot elsewhere -- a hang. ``auto``
    agrees first (crowded anywhere -> crowded everywhere), once per communicator."""
    import threading

    from minidist.comm import cost, measure
    from minidist.comm.cost import choose_algorithm

    n = 10_000  # float32: 40 kB
    assert choose_algorithm(4 * n, p, False) != choose_algorithm(4 * n, p, True)  # they would differ
    me = threading.local()
    asked = []
    monkeypatch.setattr(cost, "crowded", lambda: asked.append(me.rank) or me.rank == 0)
    monkeypatch.setenv("MINIDIST_TIMEOUT", "10")  # a regression fails in seconds, not minutes

    def body(comm):
        me.rank = comm.rank
        with measure(comm) as m:
            ys = [all_reduce(comm, np.full(n, 1.0 + k, np.float32)) for k in range(2)]
        return [c.name for c in m.calls], [float(y[0]) for y in ys]

    out = run(body, ranks=p)
    for names, firsts in out:
        assert names == [f"{choose_algorithm(4 * n, p, True)}_all_reduce"] * 2 and firsts == [p, 2 * p]
    assert sorted(asked) == list(range(p))  # each rank asked once: the agreement is cached
