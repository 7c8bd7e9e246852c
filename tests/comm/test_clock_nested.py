"""A rank that starts a ``run`` of its own (a benchmark serving on one rank, a grader) keeps its
virtual clock afterwards: the nested world's rank acts on the same thread, and when it ends the
thread reads the outer rank's clock again, not the wall clock."""

import pytest

from minidist.comm import run
from minidist.trace import clock


@pytest.fixture
def virtual(monkeypatch):
    from minidist.comm.transports import link as link_module

    monkeypatch.setenv("MINIDIST_CLOCK", "virtual")
    monkeypatch.setenv("MINIDIST_LINK", "alpha_us=1000,mbps=8")  # 1 ms a message, 1 MB/s
    monkeypatch.setenv("MINIDIST_DEVICE", "tflops=1,gBps=1,name=test")  # no op runs: no CPU time charged
    monkeypatch.setattr(link_module, "_CURRENT", [])


def test_a_nested_run_gives_the_rank_its_own_clock_back(virtual):
    """Rank 0 lets 1 s pass, runs a one-rank world that lets 0.5 s pass on its own clock (from 0), then
    reads 1 s again. Then a barrier of 2 ranks (one round: each sends the other an empty message, 1 ms
    on the link): rank 0 has rank 1's, sent at 0, long since (1 s); rank 1 takes rank 0's, sent at 1 s,
    at 1.001 s."""
    def inner(comm):
        clock.sleep(0.5)
        return clock.now()

    def body(comm):
        seen = []
        if comm.rank == 0:
            clock.sleep(1.0)
            seen += [clock.now(), run(inner, ranks=1)[0], clock.now()]
        comm.barrier()
        return seen + [clock.now()]

    zero, one = run(body, ranks=2)
    assert zero[:3] == [pytest.approx(1.0), pytest.approx(0.5), pytest.approx(1.0)]
    assert zero[3] == pytest.approx(1.0) and one == [pytest.approx(1.001)]
    assert not clock.is_virtual()  # this (test) thread acts for no rank
