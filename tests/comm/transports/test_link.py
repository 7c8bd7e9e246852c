"""The emulated link (minidist/comm/transports/link.py): a message takes alpha + bytes/bandwidth, and an
all-reduce takes what the cost model's alpha-beta counts predict for that link."""

import time

import numpy as np
import pytest

from minidist.comm import all_reduce, measure, run
from minidist.comm.transports.link import Link, parse_link, set_link


@pytest.fixture
def link():
    """set_link for the test's communicators, restored afterwards (it is process-wide)."""
    previous = []

    def use(spec):
        previous.append(set_link(spec))
    yield use
    if previous:
        set_link(previous[0])


def test_parse_link():
    one = parse_link("alpha_us=50,gbps=1")
    assert (one.alpha, one.bandwidth) == (pytest.approx(50e-6), 1e9 / 8)
    assert parse_link("mbps=100") == Link(0.0, 100e6 / 8)
    assert one.delay(1000) == pytest.approx(50e-6 + 8e-6)
    assert parse_link("") is None and parse_link("off") is None
    for bad in ["alpha_us=50", "gbps=x", "alpha=3,gbps=1", "gbps=-1"]:
        with pytest.raises(ValueError, match="link spec"):
            parse_link(bad)


@pytest.fixture
def pauses(monkeypatch):
    """The bytes of every message the link delays, from any rank's thread (wall times on a loaded
    machine bound a link's time only from below; counting its pauses catches one paid twice)."""
    paid, pause = [], Link.pause
    monkeypatch.setattr(Link, "pause", lambda self, nbytes: (paid.append(nbytes), pause(self, nbytes)))
    return paid


def _median_time(fn, comm, reps=3):
    times = []
    for _ in range(reps):
        comm.barrier()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def test_one_message_takes_alpha_plus_bytes_over_bandwidth(link, pauses):
    """A round trip (rank 0 -> 1 -> 0, timed on rank 0: no clock skew between ranks) is two messages."""
    link("alpha_us=2000,mbps=100")   # 2 ms + 80 ns per byte: 200 kB -> 18 ms
    x = np.ones(25_000, np.float64)  # 200 000 bytes

    def body(comm):
        if comm.rank == 0:
            return _median_time(lambda: (comm.send(x, 1), comm.recv(1)), comm)
        return _median_time(lambda: comm.send(comm.recv(0), 0), comm)
    round_trip = run(body, ranks=2)[0]
    want = 2 * (2e-3 + 200_000 / (100e6 / 8))
    # a shared machine's load comes on top, never off the link's time: the floor holds under any load
    # (the exact time is the virtual clock's test below); each send pays once: 3 round trips are 6
    # delayed 200 kB messages
    assert want <= round_trip, (round_trip, want)
    assert sum(n == x.nbytes for n in pauses) == 6, pauses


def test_a_ring_all_reduce_takes_the_cost_models_alpha_beta_time(link, pauses):
    """4 ranks, 400 kB: 6 rounds of alpha and 2(p-1)/p N bytes -- cost.all_reduce_counts' numbers on
    this link; the same all-reduce without a link bounds what the local copies and adds add."""
    x = np.ones(50_000, np.float64)

    def body(comm):
        with measure(comm) as m:
            t = _median_time(lambda: all_reduce(comm, x, algorithm="ring"), comm)
        return t, m.bytes_sent
    link(None)
    base = max(t for t, _ in run(body, ranks=4))
    link("alpha_us=1000,mbps=200")
    pauses.clear()
    slow = run(body, ranks=4)
    spec = parse_link("alpha_us=1000,mbps=200")
    predicted = spec.predict_all_reduce("ring", x.nbytes, 4)
    assert predicted == pytest.approx(6 * 1e-3 + 6 / 4 * 400_000 / 25e6)  # the textbook formula, by hand
    measured = max(t for t, _ in slow)
    assert slow[0][1] == 3 * 6 / 4 * 400_000  # 3 calls; the link changes the time, not the bytes
    # every round sleeps alpha + chunk/B on each rank, so the link's time is a floor under any load
    # (the exact time is the virtual clock's test below; the run without a link, base, is what the
    # local copies and adds take)
    assert predicted * 0.98 <= measured, (measured, base, predicted)
    # counted, whatever the load: each of the 4 ranks pays once per round, 6 rounds x 3 calls, and the
    # bytes paid for are the bytes sent (a sendrecv that also paid for its inner isend would double both;
    # the barriers' empty messages are left out)
    data = [n for n in pauses if n > 0]
    assert len(data) == 4 * 6 * 3 and sum(data) == 4 * slow[0][1], (len(data), sum(data))


@pytest.fixture
def virtual(monkeypatch):
    """The virtual clock on the link "alpha_us=2000,mbps=100", compute priced by a device model: these
    tests run no op, so a rank's time is its messages' alone, whatever the machine's load."""
    from minidist.comm.transports import link as link_module

    monkeypatch.setenv("MINIDIST_CLOCK", "virtual")
    monkeypatch.setenv("MINIDIST_LINK", "alpha_us=2000,mbps=100")
    monkeypatch.setenv("MINIDIST_DEVICE", "tflops=1,gBps=1,name=test")
    monkeypatch.setattr(link_module, "_CURRENT", [])  # read MINIDIST_LINK afresh


ALPHA, BETA = 2e-3, 100e6 / 8  # the virtual fixture's link, by hand: 2 ms a message, 12.5 MB/s


def test_on_the_virtual_clock_a_round_trip_is_exactly_two_messages(virtual):
    """Rank 0 sends 200 kB at time 0 (its link busy 16 ms), rank 1 takes it at 2 + 16 = 18 ms and sends
    it back (busy until 34 ms), rank 0 has it at 34 + 2 = 36 ms: 2 (alpha + n/beta)."""
    from minidist.trace import clock

    x = np.ones(25_000, np.float64)

    def body(comm):
        if comm.rank == 0:
            comm.send(x, 1)
            comm.recv(1)
        else:
            comm.send(comm.recv(0), 0)
        return clock.now()

    back, there = run(body, ranks=2)
    assert back == pytest.approx(0.036, rel=1e-12) and back == pytest.approx(2 * (ALPHA + x.nbytes / BETA))
    assert there == pytest.approx(0.034, rel=1e-12)


@pytest.mark.parametrize("p", [2, 4])
def test_on_the_virtual_clock_a_ring_all_reduce_takes_2_p_minus_1_rounds(virtual, p):
    """400 kB over p ranks: 2(p-1) rounds, each a chunk of N/p bytes to the next rank while one comes
    from the previous: every round alpha + (N/p)/beta. p = 4: 6 x (2 ms + 8 ms) = 60 ms; p = 2:
    2 x (2 ms + 16 ms) = 36 ms. On every rank, exactly, three calls in a row."""
    from minidist.trace import clock

    x = np.ones(50_000, np.float64)
    by_hand = {2: 0.036, 4: 0.060}[p]

    def body(comm):
        t = []
        for _ in range(3):
            t0 = clock.now()
            all_reduce(comm, x, algorithm="ring")
            t.append(clock.now() - t0)
        return t

    want = 2 * (p - 1) * (ALPHA + x.nbytes / p / BETA)
    assert want == pytest.approx(by_hand)
    for times in run(body, ranks=p):
        assert times == pytest.approx([by_hand] * 3, rel=1e-9), times


def test_without_a_link_sends_are_not_wrapped(link):
    link(None)
    out = run(lambda comm: ("isend_buffer" in vars(comm), comm.link), ranks=2)
    assert out == [(False, None), (False, None)]


PROGRAM = """
import time, numpy as np
from minidist.comm import world
from minidist.comm.transports.link import Link
paid, pause = [], Link.pause
Link.pause = lambda self, nbytes: (paid.append(nbytes), pause(self, nbytes))  # counted, see below
comm = world()
x = np.ones(25_000)
for _ in range(2):  # the second round trip is timed
    comm.barrier()
    t = time.perf_counter()
    if comm.rank == 0:
        comm.send(x, 1)
        comm.recv(1)
    else:
        comm.send(comm.recv(0), 0)
    dt = time.perf_counter() - t
sends = sum(n == x.nbytes for n in paid)
paid.clear()
comm.sendrecv_buffer(x, 1 - comm.rank, np.empty_like(x), 1 - comm.rank)  # the collectives' exchange
mine = [sends, sum(n == x.nbytes for n in paid)]
if comm.rank == 0:  # one line, from rank 0: mpirun interleaved two ranks' lines (1 run in 8 under load)
    other = [int(v) for v in comm.recv(1)]
    print(f"round trip {dt:.6f} paid {mine[0]} {other[0]} sendrecv paid {mine[1]} {other[1]}", flush=True)
else:
    comm.send(np.array(mine), 0)
"""


@pytest.mark.mpi
def test_the_link_delays_mpi_messages_too(tmp_path):
    import os
    import subprocess
    import sys

    script = tmp_path / "link_program.py"
    script.write_text(PROGRAM)
    env = dict(os.environ, MINIDIST_LINK="alpha_us=2000,mbps=100", MINIDIST_TIMEOUT="30")
    res = subprocess.run(["mpirun", "-n", "2", sys.executable, str(script)], capture_output=True, text=True,
                         timeout=60, env=env)
    assert res.returncode == 0, res.stderr
    times = [float(line.split()[2]) for line in res.stdout.splitlines() if line.startswith("round trip")]
    want = 2 * (2e-3 + 200_000 / (100e6 / 8))
    # one timed round trip under mpirun: the floor is exact, the ceiling generous (load comes on top);
    # that each send pays once (2 round trips: 2 messages per rank) is counted
    assert len(times) == 1 and want <= times[0] < 2 * want + 0.05, (res.stdout, want)
    # (rank 0, rank 1); the exchange pays once per rank
    assert "paid 2 2 sendrecv paid 1 1" in res.stdout, res.stdout
