"""The virtual clock (minidist/comm/clock.py) against hand-worked timelines: known op costs
(``clock.advance``), a known link, two or more ranks; and the same virtual time under load."""

import multiprocessing
import os
import time

import numpy as np
import pytest

from minidist.comm import all_reduce_async, measure, ring_all_reduce, run
from minidist.comm.clock import RankClock
from minidist.comm.transports.link import Link
from minidist.trace import clock as trace_clock

ALPHA, BW = 1e-3, 1e6        # the link of these tests: 1 ms a message, 1 MB/s
SLOP = 5e-3                  # seconds of real Python work a test's ranks may be charged beside the model


@pytest.fixture
def virtual(monkeypatch):
    monkeypatch.setenv("MINIDIST_CLOCK", "virtual")
    monkeypatch.setenv("MINIDIST_LINK", "alpha_us=1000,mbps=8")
    from minidist.comm.transports import link
    monkeypatch.setattr(link, "_CURRENT", [])  # read MINIDIST_LINK afresh


def test_a_message_arrives_alpha_plus_bytes_over_bandwidth_after_it_leaves(virtual):
    n = 2000  # 2 ms on the link

    def body(comm):
        if comm.rank == 0:
            comm.clock.advance(0.100)
            comm.send(np.zeros(n, np.uint8), 1)          # a blocking send waits for its link: 2 ms
        else:
            comm.clock.advance(0.050)
            comm.recv(0)                                 # arrives 0.100 + 1 ms + 2 ms
        return trace_clock.now()

    sender, receiver = run(body, ranks=2)
    assert 0.102 <= sender <= 0.102 + SLOP
    assert 0.103 <= receiver <= 0.103 + SLOP


def test_a_receive_posted_late_completes_at_the_receivers_own_time(virtual):
    def body(comm):
        if comm.rank == 0:
            comm.send(np.zeros(1000, np.uint8), 1)       # arrives at 2 ms
        else:
            comm.clock.advance(0.5)
            comm.recv(0)                                 # long since there: no wait
        return trace_clock.now()

    assert 0.5 <= run(body, ranks=2)[1] <= 0.5 + SLOP


def test_a_background_send_overlaps_compute(virtual):
    """isend, compute 0.3 s, wait: the 0.1 s transfer was hidden; its link is busy meanwhile, so a
    second message queues behind it."""
    n = 100_000  # 0.1 s on the link

    def body(comm):
        if comm.rank == 0:
            req = comm.isend(np.zeros(n, np.uint8), 1)
            comm.clock.advance(0.3)
            req.wait()
            t = trace_clock.now()
            comm.send(np.zeros(n, np.uint8), 1)          # leaves at 0.3, done at 0.4
            return t, trace_clock.now()
        comm.recv(0)
        t1 = trace_clock.now()                           # 0.001 + 0.1
        comm.recv(0)
        return t1, trace_clock.now()                     # leaves 0.3: 0.3 + 0.001 + 0.1

    (s1, s2), (r1, r2) = run(body, ranks=2)
    assert 0.3 <= s1 <= 0.3 + SLOP and 0.4 <= s2 <= 0.4 + SLOP
    assert 0.101 <= r1 <= 0.101 + SLOP and 0.401 <= r2 <= 0.401 + SLOP


def test_two_messages_from_one_rank_share_its_link(virtual):
    """Both leave at t = 0: the second waits for the first's bytes (one outgoing link a rank)."""
    n = 50_000  # 0.05 s each

    def body(comm):
        if comm.rank == 0:
            a, b = comm.isend(np.zeros(n, np.uint8), 1), comm.isend(np.zeros(n, np.uint8), 2)
            a.wait(), b.wait()
            return trace_clock.now()
        comm.recv(0)
        return trace_clock.now()

    sender, first, second = run(body, ranks=3)
    assert 0.1 <= sender <= 0.1 + SLOP
    assert 0.051 <= first <= 0.051 + SLOP and 0.101 <= second <= 0.101 + SLOP


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_the_ring_all_reduce_takes_its_alpha_beta_time(virtual, p):
    """2(p-1) steps of one chunk each: 2(p-1)·alpha + 2(p-1)/p·N/beta (chunks equal: p divides N)."""
    n = 24_000 * p  # float64: N = 8n bytes, each chunk 8n/p

    def body(comm):
        y = ring_all_reduce(comm, np.full(n, float(comm.rank)))
        assert y[0] == p * (p - 1) / 2
        return trace_clock.now()

    want = 2 * (p - 1) * ALPHA + 2 * (p - 1) / p * 8 * n / BW
    got = run(body, ranks=p)
    reduce_work = 0.02  # each step also adds a chunk up: real CPU time, a few ms at most
    assert all(want <= t <= want + reduce_work for t in got), (want, got)


def test_an_async_all_reduce_runs_beside_the_compute(virtual):
    """Submitted at 0, 0.2 s of compute beside it: wait() returns at max(0.2, its own end)."""
    n = 10_000  # 80 KB: 2 steps of 40 KB at p = 2: 2 ms + 80 ms

    def body(comm):
        h = all_reduce_async(comm, np.ones(n), algorithm="ring")
        comm.clock.advance(0.2)
        h.wait()
        hidden = trace_clock.now()
        h = all_reduce_async(comm, np.ones(n), algorithm="ring")
        h.wait()
        return hidden, trace_clock.now() - hidden

    for hidden, alone in run(body, ranks=2):
        assert 0.2 <= hidden <= 0.2 + SLOP
        assert 0.082 <= alone <= 0.082 + SLOP


def test_the_ledger_is_the_same_on_either_clock(virtual, monkeypatch):
    def body(comm):
        with measure(comm) as m:
            ring_all_reduce(comm, np.ones(1000))
        return m.bytes_sent, m.messages, m.header_bytes, m.steps

    on = run(body, ranks=3)
    monkeypatch.setenv("MINIDIST_CLOCK", "wall")
    assert run(body, ranks=3) == on


def test_compute_is_charged_in_cpu_time_not_wall_time():
    clock = RankClock(Link(ALPHA, BW))
    a = np.random.default_rng(0).standard_normal((300, 300))
    t0 = clock.now()
    time.sleep(0.2)                                      # waiting costs nothing
    slept = clock.now() - t0
    start = time.thread_time()
    for _ in range(20):
        a @ a
    used = time.thread_time() - start
    worked = clock.now() - t0 - slept
    assert slept < 0.01
    assert abs(worked - used) < 0.01 + 0.1 * used


def _hog(stop):
    while not stop.is_set():
        pass


def _step_time():
    """One small data-parallel-like step on 2 thread ranks: real matmuls, a ring all-reduce."""
    def body(comm):
        a = np.random.default_rng(comm.rank).standard_normal((200, 200))
        for _ in range(15):
            g = a @ a
            a = ring_all_reduce(comm, g / np.abs(g).max())
        return trace_clock.now()
    return max(run(body, ranks=2))


def test_the_virtual_time_is_the_same_under_load(virtual):
    """Two busy loops beside the run change its wall time, not its virtual time (within 2%: what the
    cores' caches and frequency still move)."""
    quiet = min(_step_time() for _ in range(3))
    stop = multiprocessing.Event()
    hogs = [multiprocessing.Process(target=_hog, args=(stop,)) for _ in range(2)]
    for h in hogs:
        h.start()
    try:
        loaded = min(_step_time() for _ in range(3))
    finally:
        stop.set()
        for h in hogs:
            h.join()
    assert abs(loaded - quiet) <= 0.02 * quiet, (quiet, loaded, os.getloadavg())


def test_an_unknown_clock_mode_is_refused(monkeypatch):
    monkeypatch.setenv("MINIDIST_CLOCK", "sundial")
    with pytest.raises(ValueError, match="MINIDIST_CLOCK='sundial': use 'wall'"):
        run(lambda comm: None, ranks=2)


def test_op_work_counts_a_products_flops_from_its_shapes():
    """2·M·K·N for a product, forward; each input gradient of a product is another; attention's
    two products; one FLOP an element for the rest (the hand-worked numbers)."""
    from minidist.autograd.ops import Add, Linear, Matmul, ScaledDotProductAttention
    from minidist.comm.clock import op_work

    x, w, y = np.ones((4, 8, 16)), np.ones((16, 32)), np.ones((4, 8, 32))
    assert op_work(Linear, [x, w], y, False)[0] == 2 * 32 * 16 * 32
    assert op_work(Linear, [y], (x, w, None), True)[0] == 2 * (2 * 32 * 16 * 32)   # dX and dW
    assert op_work(Linear, [y], (None, w, None), True)[0] == 2 * 32 * 16 * 32      # dW only
    a, b = np.ones((3, 5, 6)), np.ones((3, 6, 7))
    assert op_work(Matmul, [a, b], np.ones((3, 5, 7)), False)[0] == 2 * 3 * 5 * 6 * 7
    q, k = np.ones((2, 3, 5, 4)), np.ones((2, 3, 7, 4))
    assert op_work(ScaledDotProductAttention, [q, k, k], np.ones_like(q), False)[0] == 4 * 2 * 3 * 5 * 7 * 4
    flops, nbytes = op_work(Add, [x, x], np.ones_like(x), False)
    assert (flops, nbytes) == (x.size, 3 * x.nbytes)


def test_op_work_prices_a_view_and_a_composite_at_nothing():
    """A reshape, a transpose or a slice moves no data (its output shares the input's memory), in
    NumPy as on a device: no work at all (None: not even an op's overhead) -- but a copy (a fancy
    index) is priced. A composite op (``Recompute``) runs other ops, each priced on its own: the node
    itself costs nothing."""
    from minidist.autograd.ops import GetItem, Reshape, Transpose
    from minidist.comm.clock import op_work
    from minidist.parallel.memory.recompute import Recompute

    x = np.ones((4, 6, 8))
    assert op_work(Reshape, [x], x.reshape(24, 8), False) is None
    assert op_work(Transpose, [x], x.transpose(2, 0, 1), False) is None
    assert op_work(GetItem, [x], x[1:3], False) is None
    picked = x[[0, 2]]  # fancy indexing copies
    assert op_work(GetItem, [x], picked, False) == (picked.size, x.nbytes + picked.nbytes)
    t = x.transpose(0, 2, 1)  # (4, 8, 6): flattening its last two axes must copy
    assert op_work(Reshape, [t], t.reshape(4, 48), False)[1] == t.nbytes + t.reshape(4, 48).nbytes
    assert op_work(Recompute, [x, x], np.ones_like(x), False) is None


def test_a_device_model_prices_each_op_on_its_roofline(virtual, monkeypatch):
    """One Linear forward and backward on a device of 1 GFLOP/s and 1 GB/s, 10 us an op: each takes
    max(FLOPs / 1e9, bytes / 1e9) + 10 us, whatever the CPU does meanwhile."""
    from minidist.autograd import ops
    from minidist.autograd.tensor import Tensor

    monkeypatch.setenv("MINIDIST_DEVICE", "tflops=0.001,gBps=1,overhead_us=10,name=slow")
    rows, k, n = 64, 128, 256
    fwd = max(2 * rows * k * n, 8 * (rows * k + k * n + rows * n)) / 1e9 + 1e-5
    bwd = max(2 * 2 * rows * k * n, 8 * (rows * n + rows * k + k * n)) / 1e9 + 1e-5

    def body(comm):
        x = Tensor(np.ones((rows, k)), requires_grad=True)
        w = Tensor(np.ones((k, n)), requires_grad=True)
        t0 = trace_clock.now()
        y = ops.linear(x, w)
        t1 = trace_clock.now()
        time.sleep(0.05)
        y.backward(np.ones((rows, n)))
        return t1 - t0, trace_clock.now() - t1

    (f, b), = run(body, ranks=1)
    assert f == pytest.approx(fwd, rel=1e-9) and b == pytest.approx(bwd, rel=1e-9)
