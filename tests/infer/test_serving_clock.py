"""Serving on the virtual clock: TTFT and TPOT of colocated and disaggregated serving against
timelines worked by hand, and the same timeline on every run (a decode rank takes a cache once its
own clock reaches the arrival, however fast the host ran the ranks).

The device of these tests costs 100 us an op and nothing for FLOPs or bytes, so every forward pass
-- a prefill of any length or a decode of any batch -- costs the same c (its ops x 100 us)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from minidist.comm import run
from minidist.infer import GREEDY, Request, Scheduler
from minidist.infer.colocated import colocated_serve
from minidist.infer.disaggregated import disaggregated_serve
from minidist.nn import GPT, GPTConfig
from minidist.trace.spans import now

ROOT = Path(__file__).resolve().parents[2]
V, BLOCK = 32, 32


@pytest.fixture
def virtual(monkeypatch):
    """Threads on the virtual clock: 100 us an op; the link 0.25 c a message (set per test)."""
    monkeypatch.setenv("MINIDIST_CLOCK", "virtual")
    monkeypatch.setenv("MINIDIST_DEVICE", "tflops=1e9,gBps=1e9,overhead_us=100,name=ops")
    from minidist.comm.transports import link
    monkeypatch.setattr(link, "_CURRENT", [])

    def use_link(alpha_s):
        monkeypatch.setenv("MINIDIST_LINK", f"alpha_us={alpha_s * 1e6},gbps=1e6")  # bytes ~ free
        monkeypatch.setattr(link, "_CURRENT", [])
    return use_link


def model():
    return GPT(GPTConfig(vocab_size=V, block_size=BLOCK, n_layer=2, n_head=2, d_model=16, seed=3)).eval()


def pass_cost() -> float:
    """c: a Scheduler step decoding one request, on rank 0 of a one-rank virtual run; checks the
    premise that a prefill step costs the same and a step with a decode and a prefill twice that."""
    def body(comm):
        s = Scheduler(model(), max_batch=2)
        s.submit(Request(0, [1, 2, 3, 4, 5], 8))
        t = now()
        s.step()                                        # prefill alone
        prefill, t = now() - t, now()
        s.step()                                        # decode alone
        decode, t = now() - t, now()
        s.submit(Request(1, [6] * 12, 4, arrival=s.t))
        s.step()                                        # a decode and a prefill: two passes
        both = now() - t
        return prefill, decode, both
    prefill, decode, both = run(body, ranks=1)[0]
    assert decode > 0 and prefill == pytest.approx(decode, rel=1e-6) and both == pytest.approx(2 * decode)
    return decode


def test_colocated_timeline_by_hand(virtual):
    """2 ranks; rank 0 serves requests 0 (arrives at 0) and 2 (at 1.5c), 4 tokens each:
    step [0, c] prefills 0 (its first token at c); [c, 2c] decodes 0; request 2 has arrived by 2c, so
    [2c, 4c] decodes 0 and prefills 2 (2's first token at 4c); [4c, 5c] gives 0 its last token and 2
    its second; [5c, 6c], [6c, 7c] finish 2. TTFT: 0 -> c, 2 -> 4c - 1.5c; TPOT: 0 -> (5c - c) / 3,
    2 -> (7c - 4c) / 3. Rank 1 (requests 1 and 3) runs the same timeline."""
    virtual(0.0)
    c = pass_cost()
    reqs = [Request(i, [1 + i] * (3 + i), 4, GREEDY) for i in range(4)]
    arrivals = [0.0, 0.0, 1.5 * c, 1.5 * c]
    served = run(lambda comm: colocated_serve(comm, model(), reqs, arrivals, max_batch=4), ranks=2)[0]
    want_ttft = {0: c, 1: c, 2: 2.5 * c, 3: 2.5 * c}
    want_tpot = {0: 4 * c / 3, 1: 4 * c / 3, 2: c, 3: c}
    for got, want in ((served.ttft, want_ttft), (served.tpot, want_tpot)):
        assert set(got) == set(want)
        for i in want:
            assert got[i] == pytest.approx(want[i], rel=1e-4), (i, got[i] / c, want[i] / c)


def test_disaggregated_timeline_by_hand(virtual):
    """1 prefill rank, 1 decode rank, a link of alpha = c/4; requests 0 (at 0) and 1 (at 2.5c), 4
    tokens each. The ranks first agree on the model and requests (``start``: one message, so the
    prefill rank can begin at alpha = 0.25c). Prefill: 0 in [0.25c, 1.25c], 1 in [2.5c, 3.5c]; their
    caches arrive at 1.5c and 3.75c. Decode: idle until 1.5c, then steps [1.5c, 2.5c], [2.5c, 3.5c],
    [3.5c, 4.5c] finish 0; 1's cache, here since 3.75c, waits for that step and runs [4.5c, 7.5c].
    TTFT 0 -> 1.25c, 1 -> c; TPOT 0 -> (4.5c - 1.25c) / 3, 1 -> (7.5c - 3.5c) / 3: a cache that lands
    mid-step waits for the step."""
    c = pass_cost()
    virtual(c / 4)
    reqs = [Request(i, [2 + i] * (4 + 3 * i), 4, GREEDY) for i in range(2)]
    served = run(lambda comm: disaggregated_serve(comm, model(), reqs, [0.0, 2.5 * c], prefill_ranks=1),
                 ranks=2)[0]
    for got, want in ((served.ttft, {0: 1.25 * c, 1: c}), (served.tpot, {0: 3.25 * c / 3, 1: 4 * c / 3})):
        assert set(got) == set(want)
        for i in want:
            assert got[i] == pytest.approx(want[i], rel=1e-4), (i, got[i] / c, want[i] / c)


def test_the_virtual_timeline_is_the_same_every_run(virtual):
    """A busy workload on 3 ranks (1 prefill, 2 decode): the host runs the ranks at whatever pace,
    yet every TTFT and TPOT is the same on a second run (and the tokens are)."""
    virtual(2e-4)
    rng = np.random.default_rng(0)
    reqs = [Request(i, list(rng.integers(0, V, rng.integers(2, 20))), int(rng.integers(2, 8)), GREEDY)
            for i in range(12)]
    arrivals = sorted(rng.uniform(0, 0.05, len(reqs)))

    def serve():
        return run(lambda comm: disaggregated_serve(comm, model(), reqs, arrivals, prefill_ranks=1,
                                                    max_batch=2), ranks=3)[0]
    first, second = serve(), serve()
    assert first.outputs == second.outputs
    assert first.ttft == second.ttft and first.tpot == second.tpot


def test_scheduler_ttft_reads_the_rank_clock(virtual):
    """``Request.ttft_s`` is virtual seconds: a request arriving at step 1 behind a running one waits
    for step 0's pass, then its own step: 1 pass (c) from joining the queue to its first token."""
    virtual(0.0)
    c = pass_cost()

    def body(comm):
        s = Scheduler(model(), max_batch=2)
        reqs = [Request(0, [1, 2, 3], 3), Request(1, [4, 5], 2, arrival=1)]
        s.run(reqs)
        return [r.ttft_s for r in sorted(s.done, key=lambda r: r.id)], s.stats["seconds"]
    (ttft0, ttft1), seconds = run(body, ranks=1)[0]
    # step 0: prefill 0 (c); step 1: decode 0 + prefill 1 (2c); step 2: decode 0 and 1 -> done (c)
    assert ttft0 == pytest.approx(c) and ttft1 == pytest.approx(2 * c) and seconds == pytest.approx(4 * c)



PROGRAM = """
from minidist.comm import run
from minidist.infer import GREEDY, Request
from minidist.infer.colocated import colocated_serve
from minidist.infer.disaggregated import disaggregated_serve
from minidist.nn import GPT, GPTConfig
m = GPT(GPTConfig(vocab_size=32, block_size=48, n_layer=2, n_head=2, d_model=32, seed=2)).eval()
rs = [Request(i, [1 + i % 7] * (2 + 9 * (i % 3)), 3 + i % 4, GREEDY) for i in range(7)]
def body(c):
    at = [0.004 * i for i in range(7)]
    return c.rank, disaggregated_serve(c, m, rs, at, prefill_ranks=1), colocated_serve(c, m, rs, at)
rank, d, co = run(body, ranks=3)[0]
if rank == 0:
    print("TIMES", *(sorted(x.items()) for x in (d.ttft, d.tpot, co.ttft, co.tpot)))
"""


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun (pip install mpich)")
def test_mpirun_serves_the_threads_timeline():
    """The same workload on 3 MPI processes and on 3 threads: every TTFT and TPOT, disaggregated
    and colocated, the same virtual seconds (MPI carries each message's arrival in its header)."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT), MINIDIST_CLOCK="virtual",
               MINIDIST_DEVICE="tflops=1e9,gBps=1e9,overhead_us=100", MINIDIST_LINK="alpha_us=300,gbps=100")
    env.pop("MINIDIST_TRANSPORT", None)
    times = []
    for cmd in (["mpirun", "-n", "3", sys.executable, "-c", PROGRAM], [sys.executable, "-c", PROGRAM]):
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
        assert res.returncode == 0, res.stdout + res.stderr
        times.append([line for line in res.stdout.splitlines() if line.startswith("TIMES")])
    assert len(times[0]) == 1 and times[0] == times[1]
