"""calibrate_cores' arithmetic, on work and clocks the test controls (the machine's speed never enters)."""

import pytest

from minidist.plan import calibrate_cores


@pytest.mark.parametrize("threads, cores", [(1, 0.5), (2, 1.0)])
def test_effective_cores_is_cpu_seconds_alone_over_wall_seconds_together(monkeypatch, threads, cores):
    """Clocks the test controls: the work needs 10 ms of CPU alone (the `cpu` clock), and the threads
    together take 20 ms of wall time -- each thread gets half a core, so `threads` threads get
    threads/2 cores' worth: one rank alone on a machine where another program takes turns with it
    gets 0.5 (a first version floored the answer at 1/threads: 1 for one thread, and a single rank
    under load looked like a whole core). No real clock is read, so load cannot move the answer."""
    calls = []

    def timed(fn, repeats=7, min_time=0.02, clock=None):
        fn()  # the work (a no-op here) and the threads that run it together really run
        calls.append(clock)
        return 0.010 if clock is calibrate_cores.cpu else 0.020
    monkeypatch.setattr(calibrate_cores, "_median_time", timed)
    monkeypatch.setattr(calibrate_cores, "_work", lambda *a: lambda: None)
    got = calibrate_cores.effective_cores(threads, minidist_ops=True, batch=1)
    assert got == pytest.approx(cores)
    assert calls.count(calibrate_cores.cpu) == 3 and len(calls) == 6  # three turns of alone, together


def test_alpha_and_beta_come_back_from_exact_times_and_alpha_survives_noise_on_big_messages():
    """Times of a 2-rank ring (2 rounds, each rank sends the whole message: 2·(p-1)/p·N bytes) made
    from alpha = 50 us a round, beta = 1 ns a byte: the fit returns them. Then 20% noise on the 4 MB
    message alone (8.1 ms -> 9.7 ms): alpha still within 10% -- it comes from the small messages it
    dominates (plain least squares put it at 17 us, a third)."""
    sizes = [4096, 65536, 1 << 20, 1 << 22]
    times = [2 * 50e-6 + n * 1e-9 for n in sizes]
    alpha, beta = calibrate_cores.fit_link("ring", 2, sizes, times)
    assert (alpha, beta) == (pytest.approx(50e-6), pytest.approx(1e-9))
    noisy = times[:3] + [times[3] * 1.2]
    alpha, _ = calibrate_cores.fit_link("ring", 2, sizes, noisy)
    assert alpha == pytest.approx(50e-6, rel=0.1)
