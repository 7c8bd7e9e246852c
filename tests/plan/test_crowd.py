"""The planner's step time for MPI processes sharing this machine's cores (`Hardware.crowds`, from
calibrate's mpirun probe), and the bytes it predicts under mpirun against the ledger.

Expected times are added up by hand from hand-written constants; expected bytes come from the
ledger of a real `mpirun` run.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from minidist.plan.hardware import Crowd, Hardware, Link
from minidist.plan.mesh import Candidate
from minidist.plan.model import ModelSpec
from minidist.plan.steptime import predict

ROOT = Path(__file__).resolve().parents[2]
SPEC = ModelSpec("tiny", n_layer=2, d_model=16, n_head=4, vocab=32, seq=8, engine="minidist", dtype_bytes=4)
B = 8
FREE = 1e30  # bytes/s: a link whose bytes cost nothing, so only its latency counts


def crowd(ranks, cores, fg, bg, python=0.0):
    """A probe result: `ranks` processes get `cores` cores' worth; all-reduce rounds cost fg seconds in
    the foreground (tensor parallel) and bg on the communication thread (DDP); each second of a
    rank's Python costs `python` seconds more."""
    return Crowd(ranks, cores, {"ring": {"fg": Link(FREE, fg), "bg": Link(FREE, bg)}}, python)


def machine(crowds=()):
    """Arithmetic free; Python 1 ms per block and 2 ms for embedding + head (4 ms a microbatch of
    SPEC); the threads link 1 ms per round; 2 CPUs, 1.9 cores free; MPI processes."""
    k = {"linear_flops": 1e30, "gelu": 0.0, "layer_norm": 0.0, "elementwise": 0.0, "attention_score": 0.0,
         "cross_entropy": 0.0, "adamw": 0.0, "python_block": 1e-3, "python_ends": 2e-3}
    link = Link(FREE, 1e-3, "threads")
    return Hardware("hand", 1e12, 1e12, 1e12, intra=link, inter=link, chips_per_domain=10**6,
                    gemm_efficiency=1.0, kernels=k, cores=1.9, cpus=2, transport="mpi", crowds=tuple(crowds))


PROBED = machine([crowd(2, 1.6, fg=0.5e-3, bg=0.25e-3), crowd(8, 0.5, fg=5e-3, bg=2e-3)])


def test_processes_outnumbering_the_cores_run_at_the_probed_cores_and_links():
    """dp8: 8 processes get 0.5 cores' worth -> each rank's 4 ms of work takes 8 / 0.5 x 4 ms; DDP's
    ring all-reduce (one bucket, 2(p-1) = 14 rounds) at the probe's background latency, 2 ms a round,
    which is already wall time: not stretched again, and not hidden under a backward that is itself
    waiting for the cores."""
    step = predict(SPEC, Candidate(dp=8, microbatch_size=1), B, PROBED).step
    assert step == pytest.approx(8 / 0.5 * 4e-3 + 14 * 2e-3)


def test_tensor_parallel_all_reduces_use_the_foreground_link():
    """dp1 tp2, one microbatch of 8: 2 processes get 1.6 cores' worth -> 2 / 1.6 x 4 ms of work.
    TP all-reduces per step: forward 2 per block + the embedding's + 3 small ones of the loss = 8,
    backward 2 per block + the head's = 5; each 2(p-1) = 2 rounds of the probe's foreground 0.5 ms."""
    step = predict(SPEC, Candidate(tp=2, microbatch_size=8), B, PROBED).step
    assert step == pytest.approx(2 / 1.6 * 4e-3 + (8 + 5) * 2 * 0.5e-3)


def test_tensor_parallel_pairs_inside_a_crowd_use_the_pairs_link_stretched_by_the_rest():
    """dp4 tp2 = 8 processes, 0.5 cores' worth: each rank's 4 ms of work x 16. The 13 tp all-reduces
    of 2 rounds are a pair's, called while the other 6 processes compute: the probe's link for 2
    processes (0.5 ms a round), its work taking turns with the rest, x (8 / 0.5) / (2 / 1.6) = 12.8
    -- not the 8-process crowd's 5 ms, measured with everyone all-reducing at once. DDP's ring
    over dp4 (6 rounds) at the end of the backward: the 8-process background link, 2 ms a round."""
    step = predict(SPEC, Candidate(dp=4, tp=2, microbatch_size=2), B, PROBED).step
    assert step == pytest.approx(8 / 0.5 * 4e-3 + (8 + 5) * 2 * 0.5e-3 * (8 / 0.5) / (2 / 1.6) + 6 * 2e-3)


def test_between_and_beyond_the_probes():
    """4 processes: the next larger probe (8: 0.5 cores, 2 ms per background round), dp4's ring has
    6 rounds. 16 processes: the largest probe's cores, every round 16 / 8 times as long."""
    dp4 = predict(SPEC, Candidate(dp=4, microbatch_size=2), B, PROBED).step
    assert dp4 == pytest.approx(4 / 0.5 * 4e-3 + 6 * 2e-3)
    dp16 = predict(SPEC, Candidate(dp=16, microbatch_size=1), 16, PROBED).step
    assert dp16 == pytest.approx(16 / 0.5 * 4e-3 + 30 * 2 * 2e-3)


def test_without_a_probe_processes_get_the_free_cores_and_the_threads_link():
    """An old calibration (no "processes"): 8 processes on 1.9 free cores, the work stretched 8 / 1.9
    times; the all-reduce's 14 rounds at the threads link's 1 ms, a link measured with 2 ranks
    sharing the cores: stretched by (8 / 1.9) / (2 / 1.9) = 4."""
    step = predict(SPEC, Candidate(dp=8, microbatch_size=1), B, machine()).step
    assert step == pytest.approx(8 / 1.9 * 4e-3 + 4 * 14 * 1e-3)


def test_crowded_processes_lose_the_probes_share_of_their_python():
    """The probe says 8 processes lose 0.5 s per second of Python besides their cores' worth (0.5).
    SPEC's microbatch is all Python here (4 ms) -> 8 / 0.5 x 4 ms x 1.5; the update's Python (29
    tensors x 0.1 ms + 1 ms) x 1.5 x 16 too. 2 processes fit on the 2 CPUs: no turns, no loss."""
    k = {**PROBED.kernels, "python_tensor": 1e-4, "python_step": 1e-3}
    hw = PROBED.with_(kernels=k, crowds=(crowd(2, 1.6, 0.5e-3, 0.25e-3, python=0.5),
                                         crowd(8, 0.5, 5e-3, 2e-3, python=0.5)))
    update = 29e-4 + 1e-3
    dp8 = predict(SPEC, Candidate(dp=8, microbatch_size=1), B, hw).step
    assert dp8 == pytest.approx(8 / 0.5 * 1.5 * (4e-3 + update) + 14 * 2e-3)
    dp2 = predict(SPEC, Candidate(dp=2, microbatch_size=4), B, hw).step
    assert dp2 == pytest.approx(2 / 1.6 * (4e-3 + update) + 2 * 0.25e-3)


def test_a_whole_step_is_its_parts_times_cold():
    """calibrate's `cold` (a whole step over its parts one at a time) multiplies a rank's work:
    4 ms of Python x 1.25 for one rank alone."""
    hw = PROBED.with_(kernels={**PROBED.kernels, "cold": 1.25}, cores=0, crowds=())
    assert predict(SPEC, Candidate(microbatch_size=8), B, hw).step == pytest.approx(1.25 * 4e-3)
    # 2 thread ranks: their Python takes turns on one GIL, 2 x 4 ms x 1.25 one after the other; the
    # all-reduce's 2 rounds of 1 ms as measured (with 2 ranks)
    threads = hw.with_(cores=1.5, cpus=2, gil=True, transport="threads")
    assert predict(SPEC, Candidate(dp=2, microbatch_size=4), B, threads).step == pytest.approx(
        2 * 1.25 * 4e-3 + 2e-3)


def test_crowd_fit_reads_cores_and_python_off_the_fat_and_thin_steps():
    """8 processes on 2 CPUs, made-up timings: alone 20 ms (fat) and 4 ms (thin), together 100 ms
    and 30 ms. The difference, 70 ms for 16 ms of arithmetic: 8 / cores = 70 / 16 -> cores = 8 x
    16 / 70 = 1.829. The thin step stretched would take 4 x 70 / 16 = 17.5 ms; the other 12.5 ms
    are 12.5 / (70 / 16) = 2.857 ms of a rank's own time, over its 2 ms of Python: 1.429."""
    from minidist.plan.calibrate_mpi import crowd_fit

    cores, python = crowd_fit(8, {16: 20e-3, 2: 4e-3}, {16: 100e-3, 2: 30e-3}, 2e-3, cpus=2)
    assert cores == pytest.approx(8 * 16 / 70)
    assert python == pytest.approx((30 - 4 * 70 / 16) / (70 / 16) / 2)
    # the cores' worth is never more than the CPUs, nor a loss below nothing
    cores, python = crowd_fit(8, {16: 20e-3, 2: 4e-3}, {16: 40e-3, 2: 4e-3}, 2e-3, cpus=2)
    assert (cores, python) == (2.0, 0.0)


def test_thread_ranks_get_the_cores_measured_for_their_count():
    """calibrate's `threads`: 2 ranks 1.5 cores, 4 ranks 1.2, 8 ranks 0.6. 3 ranks take the next
    larger count's (4: 1.2), 16 the crowded cores past the largest (0.5)."""
    from minidist.plan.steptime import rank_slowdown

    link = Link(FREE, 1e-3)
    hw = Hardware("hand", 1e12, 1e12, 1e12, intra=link, inter=link, chips_per_domain=10**6, cores=1.5,
                  cores_crowded=0.5, cpus=2, gil=True, threads=((2, 1.5), (4, 1.2), (8, 0.6)))
    assert [rank_slowdown(hw, n) for n in (2, 3, 4, 8, 16)] == pytest.approx(
        [2 / 1.5, 3 / 1.2, 4 / 1.2, 8 / 0.6, 16 / 0.5])
    # an older calibration (no per-count list): cores while they fit, the crowded cores past the CPUs
    old = hw.with_(threads=())
    assert [rank_slowdown(old, n) for n in (2, 4)] == pytest.approx([2 / 1.5, 4 / 0.5])
    # one rank alone gets 0.8 of a core (another program takes turns on it): 1 / 0.8, thread or process
    assert rank_slowdown(hw.with_(cores_one=0.8), 1) == pytest.approx(1.25)
    assert rank_slowdown(hw.with_(cores_one=0.8, gil=False), 1) == pytest.approx(1.25)


def test_here_reads_the_probe(tmp_path):
    import json

    from minidist.plan import hardware

    c = {"cpu": "X", "cores": 2, "cores_free": 1.9, "cores_threads": 1.5, "cores_threads_crowded": 0.8,
         "flops": 5e10, "mem_bandwidth": 2e10, "op_overhead": 1e-5, "alpha": 2e-5, "beta": 1e-9,
         "processes": [{"ranks": 4, "cores": 1.2, "python": 0.3,
                        "links": {"ring": {"fg": [3e-4, 1e-9], "bg": [1e-4, 2e-9]}}}],
         "threads": [{"ranks": 1, "cores": 0.9}, {"ranks": 2, "cores": 1.5}, {"ranks": 8, "cores": 0.7}]}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(c))
    mpi, threads = hardware.here(str(path), transport="mpi"), hardware.here(str(path))
    assert threads.crowds == () and threads.crowd(4) is None  # thread ranks: the GIL model, no probe
    got = mpi.crowd(3)
    assert (got.ranks, got.cores, got.python) == (4, 1.2, 0.3)
    assert threads.threads == ((1, 0.9), (2, 1.5), (8, 0.7)) and mpi.threads == ()
    assert threads.cores_one == mpi.cores_one == 0.9
    assert got.link("ring", background=False).latency == 3e-4
    assert got.link("ring", background=True).bandwidth == pytest.approx(5e8)
    assert mpi.crowd(1) is None
    # the machine's own link is the threads one (alpha, beta), whatever the transport: so named
    assert (mpi.intra.latency, mpi.intra.bandwidth) == (2e-5, pytest.approx(1e9)) and mpi.inter == mpi.intra
    assert mpi.intra.name.startswith("threads transport") and threads.intra.name == "threads transport"


# float32 elements, latency-bound to windowed (shm: 1 MiB pieces); uneven chunks for shm and the
# ring, multiples of 12 where the cost model's byte formulas (exact when p divides them) count
SIZES = (10, 1000, 70_001, 300_001)
EVEN = (12, 1200, 70_008, 300_000)


def auto_calls(comm, background=False, sizes=SIZES):
    """(name, bytes sent) of each `all_reduce(..., algorithm="auto")` of `sizes`, from the ledger."""
    import numpy as np

    from minidist.comm import all_reduce, all_reduce_async, measure

    out = []
    for n in sizes:
        x = np.ones(n, np.float32)
        with measure(comm) as meas:
            all_reduce_async(comm, x, algorithm="auto").wait() if background else \
                all_reduce(comm, x, algorithm="auto")
        out.append([(c.name, c.bytes_sent) for c in meas.calls])
    return out


def check_auto(calls, p, rank, where, sizes=SIZES):
    """The planner's algorithm and bytes for an "auto" all-reduce == the ledger's, size by size."""
    from minidist.plan.traffic import all_reduce_call

    for n, got in zip(sizes, calls):
        want = all_reduce_call("dp", "auto", 4 * n, p, 4, rank, 1, "step", where)
        assert got == [(want.name, want.sent)], f"rank {rank} of {p}, {n} elements: {got} != {want}"


@pytest.mark.parametrize("p", [3, 4])
def test_auto_all_reduce_follows_the_comm_layer_on_threads(p):
    """Threads: "auto" is the cost model's choice per size; the planner asks the same question."""
    from minidist.comm import run
    from minidist.plan.traffic import THREADS

    for rank, calls in enumerate(run(auto_calls, ranks=p, sizes=EVEN)):
        check_auto(calls, p, rank, THREADS, EVEN)


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
def test_bytes_equal_the_ledger_under_mpirun():
    """4 MPI processes (more than the cores on a small machine: the comm layer's crowded choices):
    every rank's ledger calls and bytes == the planner's, placed on the MPI transport."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("MINIDIST_TRANSPORT", None)
    res = subprocess.run(["mpirun", "-n", "4", sys.executable, __file__], capture_output=True, text=True,
                         timeout=120, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("OK rank") == 4 * 3, res.stdout


def _mpi_main():
    from minidist.comm import cost, run
    from minidist.plan.traffic import Placement
    from tests.plan.conftest import CFG, check_mesh
    from tests.plan.conftest import SPEC as TINY

    where = Placement("mpi", cost.crowded(), shared_memory=True)  # one node: "auto" takes shm
    for dp, tp, pp, m in [(2, 2, 1, 2), (2, 1, 2, 2)]:
        check_mesh(dp, tp, pp, m, None, CFG, TINY, where=where)
        print(f"OK rank {os.environ.get('PMI_RANK')} dp{dp} tp{tp} pp{pp}", flush=True)

    def auto(comm):  # in the foreground (TP's way) and on the communication thread (DDP's)
        for background in (False, True):
            check_auto(auto_calls(comm, background), comm.size, comm.rank, where)
        return comm.rank
    print(f"OK rank {run(auto)[0]} auto all-reduce", flush=True)


if __name__ == "__main__":
    _mpi_main()
