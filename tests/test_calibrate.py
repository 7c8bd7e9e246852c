"""calibrate's own arithmetic, on work and clocks the test controls (the machine's speed never enters)."""

import time

import pytest

from minidist import calibrate


@pytest.mark.parametrize("threads, cores", [(1, 0.5), (2, 1.0)])
def test_effective_cores_is_cpu_seconds_alone_over_wall_seconds_together(monkeypatch, threads, cores):
    """The work is a 20 ms sleep (threads sleep side by side), and the CPU clock runs at half the wall
    clock: each thread needs 10 ms of CPU and gets it in 20 ms, half a core each -- one rank alone
    on a machine where another program takes turns with it gets 0.5 (a first version floored the
    answer at 1/threads: 1 for one thread, and a single rank under load looked like a whole core)."""
    monkeypatch.setattr(calibrate, "cpu", lambda: time.perf_counter() / 2)
    monkeypatch.setattr(calibrate, "_work", lambda *a: lambda: time.sleep(0.02))
    got = calibrate.effective_cores(threads, minidist_ops=True, batch=1)
    assert got == pytest.approx(cores, rel=0.2)
