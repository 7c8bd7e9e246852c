"""No silent hangs: debug mode catches mismatched collectives; the watchdog names stuck ranks."""

import re
import time

import numpy as np
import pytest

from minidist.comm import (
    CollectiveMismatch,
    CommTimeout,
    MessageMismatch,
    RankExited,
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


# -- always-on checks: a mismatch is an error without debug mode, never garbage --------------------

def _two_ranks(body, timeout="60", ranks=2):
    """Run ``body`` on 2 thread ranks with a long watchdog: whatever is raised comes from a check,
    within a second, not from the timeout."""
    import os

    saved = os.environ.get("MINIDIST_TIMEOUT")
    os.environ["MINIDIST_TIMEOUT"] = timeout
    t = time.monotonic()
    try:
        run(body, ranks=ranks)
    finally:
        if saved is None:
            del os.environ["MINIDIST_TIMEOUT"]
        else:
            os.environ["MINIDIST_TIMEOUT"] = saved
    return time.monotonic() - t


MISMATCHES = {  # rank 0's call, rank 1's call, what the error must say
    "dtype, same bytes": (lambda c: all_reduce(c, np.ones(8), algorithm="ring"),
                          lambda c: all_reduce(c, np.ones(16, np.float32), algorithm="ring"),
                          r"dtype float(32|64)"),
    "dtype, two-shot (several receives in flight)": (
        lambda c: all_reduce(c, np.ones(8), algorithm="two_shot"),
        lambda c: all_reduce(c, np.ones(16, np.float32), algorithm="two_shot"), r"dtype float(32|64)"),
    "op": (lambda c: all_reduce(c, np.ones(8), op="sum", algorithm="ring"),
           lambda c: all_reduce(c, np.ones(8), op="max", algorithm="ring"), r"op (sum|max)"),
    "collective": (lambda c: all_reduce(c, np.ones(4), algorithm="ring"),
                   lambda c: all_gather(c, np.ones(4)), r"all_gather call #1"),
    "auto's handshake against another collective": (
        lambda c: all_reduce(c, np.ones(3)), lambda c: all_gather(c, np.ones(3)),
        r"all_reduce\(auto\).*all_gather call #1"),
    "skipped call": (lambda c: [broadcast(c, np.ones(2)), all_reduce(c, np.ones(6), algorithm="ring")],
                     lambda c: all_reduce(c, np.ones(6), algorithm="ring"),  # rank 2 skips the broadcast
                     r"ring_all_reduce call #1 .*next message is a message of ring_all_reduce call #2"),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_mismatched_calls_raise_at_once_without_debug_mode(case, monkeypatch):
    monkeypatch.delenv("MINIDIST_DEBUG", raising=False)
    first, second, says = MISMATCHES[case]
    t = time.monotonic()
    p = 3 if case == "skipped call" else 2  # ranks 0, 1 call `first`, rank 2 `second`
    with pytest.raises(CollectiveMismatch, match=says) as info:
        _two_ranks(lambda comm: first(comm) if comm.rank < p - 1 else second(comm), ranks=p)
    assert re.search(rf"rank \d of {p} \(threads\), in .*: waits for .* from rank \d, but rank \d's next "
                     r"message is", str(info.value)), info.value
    assert time.monotonic() - t < 5  # a check, not the 60 s watchdog


def test_size_mismatch_is_an_error_not_garbage(monkeypatch):
    monkeypatch.delenv("MINIDIST_DEBUG", raising=False)
    with pytest.raises(MessageMismatch, match=r"received float64\[[45]\] from rank [01] into a buffer"):
        _two_ranks(lambda comm: all_reduce(comm, np.ones(8 + comm.rank), algorithm="ring"))


def test_rank_that_returns_is_reported_to_its_waiting_peer_at_once():
    def body(comm):
        if comm.rank == 0:
            all_reduce(comm, np.ones(3), algorithm="ring")  # rank 1 never joins: it has returned

    t = time.monotonic()
    with pytest.raises(RankExited, match=r"rank 0 of 2 \(threads\), in ring_all_reduce #1: rank 1 returned"):
        _two_ranks(body)
    assert time.monotonic() - t < 5  # not the 60 s watchdog


def test_debug_mode_checks_before_autos_handshake_and_catches_root(monkeypatch):
    """The full signature is compared before any message -- also before ``all_reduce(auto)``'s
    agreement on the cost model -- and names broadcast's root, which the stamp holds only mod 4."""
    monkeypatch.setenv("MINIDIST_DEBUG", "1")
    says = r"differing: .*collective.*\n  rank 0: collective=all_reduce"
    with pytest.raises(CollectiveMismatch, match=says):
        _two_ranks(lambda c: all_reduce(c, np.ones(3)) if c.rank == 0 else all_gather(c, np.ones(3)))
    with pytest.raises(CollectiveMismatch, match=r"differing: root\b"):
        run(lambda comm: broadcast(comm, np.ones(3), root=0 if comm.rank == 0 else 4), ranks=5)


def test_watchdog_prints_still_waiting_early_naming_op_and_missing_ranks(monkeypatch, capsys):
    monkeypatch.setenv("MINIDIST_TIMEOUT", "3")  # the line comes at min(10 s, timeout / 2)

    def body(comm):
        if comm.rank == 0:
            all_gather(comm, np.ones(2))
        else:
            comm.recv(0, tag=9)

    with pytest.raises(CommTimeout):
        run(body, ranks=2)
    err = capsys.readouterr().err
    assert re.search(r"\[minidist\] rank 0 of 2 \(threads\): still waiting after [23] s in all_gather #1 "
                     r"for a message from rank 1 .*; ranks not there yet: \[1\]; raises at 3 s", err), err


def test_an_expected_long_wait_prints_no_still_waiting_line_but_still_times_out(monkeypatch, capsys):
    monkeypatch.setenv("MINIDIST_TIMEOUT", "2")

    def body(comm):  # each rank waits for a message the other never sends
        with comm.patient("the other rank trains"):
            comm.recv(1 - comm.rank, tag=9)  # the watchdog must still fire

    with pytest.raises(CommTimeout):
        run(body, ranks=2)
    assert "still waiting" not in capsys.readouterr().err

    def hurried(comm):
        with comm.patient("the other rank trains"):
            pass
        comm.recv(1 - comm.rank, tag=9)  # outside patient(): the line is back

    with pytest.raises(CommTimeout):
        run(hurried, ranks=2)
    assert "still waiting" in capsys.readouterr().err


@pytest.mark.parametrize("peer", ["raises", "returns"])
def test_wait_any_raises_a_failed_or_departed_peer_at_once_not_at_the_timeout(peer, monkeypatch):
    """wait_any (disaggregated serving's decode rank waits there for prefilled caches) sees what
    wait_all sees: before issue 40's fix, a peer that raised or returned left it waiting the whole
    MINIDIST_TIMEOUT."""
    monkeypatch.setenv("MINIDIST_TIMEOUT", "8")
    seen = []

    def body(comm):
        if comm.rank == 0:
            if peer == "raises":
                raise ZeroDivisionError("rank 0 broke")
            return
        try:
            comm.wait_any([comm.irecv(0, tag=3), comm.irecv(0, tag=4)], "a message from rank 0")
        except Exception as e:  # what ended the wait
            seen.append(type(e).__name__)
            raise

    t = time.monotonic()
    with pytest.raises((ZeroDivisionError, RankExited)):
        run(body, ranks=2)
    assert time.monotonic() - t < 4 and seen in (["RankAborted"], ["RankExited"]), seen
