"""Pipeline runtime: partitions, stages, schedules executed on threads == the serial model; the lesson."""

import itertools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist import trace
from minidist.comm import run
from minidist.nn import GPT, GPTConfig
from minidist.nn.footprint import MemoryAccountant
from minidist.parallel.pipeline.catalog import make_schedule
from minidist.parallel.pipeline.partition import (
    format_partition,
    layer_costs,
    partition_balanced,
    partition_uniform,
)
from minidist.parallel.pipeline.runtime import run_schedule, split_microbatches
from minidist.parallel.pipeline.schedule import Backward, Forward, ScheduleError, one_f_one_b
from minidist.parallel.pipeline.simulate import measured_costs, peak_activations, simulate
from minidist.parallel.pipeline.stage import PipelineStage
from tests.conftest import budget

ROOT = Path(__file__).resolve().parents[3]
CFG = GPTConfig(vocab_size=16, block_size=4, n_layer=3, n_head=2, d_model=8, dtype="float64")


# -- partitioning ------------------------------------------------------------------------------------

def _is_cover(bounds, n):
    return bounds[0][0] == 0 and bounds[-1][1] == n and all(a < b for a, b in bounds) and \
        all(bounds[i][1] == bounds[i + 1][0] for i in range(len(bounds) - 1))


@given(st.integers(1, 20), st.integers(1, 20))
def test_uniform_partition_covers_evenly(n, p):
    if p > n:
        with pytest.raises(ValueError, match="at most"):
            partition_uniform(n, p)
        return
    bounds = partition_uniform(n, p)
    sizes = [b - a for a, b in bounds]
    assert len(bounds) == p and _is_cover(bounds, n) and max(sizes) - min(sizes) <= 1


@given(st.lists(st.floats(0.1, 10.0), min_size=1, max_size=7), st.integers(1, 4))
def test_balanced_partition_is_optimal(costs, p):
    """Brute force over every way to cut: the DP finds the smallest possible slowest stage."""
    n = len(costs)
    if p > n:
        with pytest.raises(ValueError):
            partition_balanced(costs, p)
        return
    bounds = partition_balanced(costs, p)
    assert len(bounds) == p and _is_cover(bounds, n)
    got = max(sum(costs[a:b]) for a, b in bounds)
    best = min(max(sum(costs[a:b]) for a, b in zip((0,) + cuts, cuts + (n,)))
               for cuts in itertools.combinations(range(1, n), p - 1))
    assert got == pytest.approx(best)
    assert got <= max(sum(costs[a:b]) for a, b in partition_uniform(n, p)) + 1e-12


def test_layer_costs_and_format():
    """Bytes are the parameters' bytes; times add up: the per-layer forward+backward times sum to
    the whole model's forward+backward time (within 2x either way), and identical blocks cost alike.
    Timed on the rank's clock, here a virtual one in this thread's CPU time (one BLAS thread), so a
    loaded machine doesn't skew it."""
    import time as clock

    from minidist.comm.clock import RankClock

    model = GPT(CFG.replace(vocab_size=512, block_size=16, d_model=32))
    by_bytes = layer_costs(model, None, by="params")
    assert by_bytes == [sum(p.data.nbytes for p in layer.parameters()) for layer in model]
    x = np.zeros((4, 16), np.int64)
    RankClock(device=None).adopt_thread()
    try:
        times = layer_costs(model, x, by="time", repeats=5)
    finally:
        RankClock.release_thread()
    whole = []
    for _ in range(5):
        t0 = clock.thread_time()
        out = model(x)
        out.backward(np.ones(out.shape))
        whole.append(clock.thread_time() - t0)
    total = float(np.median(whole))
    assert len(times) == len(model) and all(t > 0 for t in times)
    assert 0.5 * total <= sum(times) <= 2 * total, (times, total)
    blocks = times[1:-1]  # Embed, Block x 3, Head: the blocks are the same computation
    assert max(blocks) <= 2 * min(blocks), blocks
    assert format_partition([(0, 2), (2, 3)], [1.0, 2.0, 1.0], " s").splitlines() == [
        "stage 0: layers 0..1 (2 layers)  predicted cost 3 s (75%)",
        "stage 1: layers 2..2 (1 layer)  predicted cost 1 s (25%)"]
    assert format_partition([(0, 1), (1, 3)]).splitlines() == ["stage 0: layers 0..0 (1 layer)",
                                                                "stage 1: layers 1..2 (2 layers)"]
    with pytest.raises(ValueError, match="'time' or 'params'"):
        layer_costs(model, None, by="flops")


def test_batch_must_split_into_microbatches():
    with pytest.raises(ValueError, match="does not split into 3 equal microbatches"):
        split_microbatches(np.zeros((8, 4)), 3)
    assert [len(x) for x in split_microbatches(np.zeros((8, 4)), 4)] == [2] * 4


def test_unknown_schedule():
    with pytest.raises(ScheduleError, match="unknown schedule"):
        make_schedule("zigzag", 2, 2)


# -- the runtime on threads equals the serial model ------------------------------------------------

def _serial_grads(x, y, cfg=CFG):
    model = GPT(cfg)
    loss = model.loss(x, y)
    loss.backward()
    return float(loss.item()), {n: p.grad for n, p in model.named_parameters()}


def _pipeline_rank(comm, schedule, m, chunks, x, y, cfg=CFG):
    model = GPT(cfg)
    p = comm.size
    stage = PipelineStage(model, partition_uniform(len(model), p * chunks), comm.rank, p)
    tracer, outer = trace.Tracer(comm.rank), MemoryAccountant()
    with trace.tracing(tracer), outer.track_activations(model=stage):  # must still see every array
        stats = run_schedule(stage, comm, make_schedule(schedule, p, m, chunks)[comm.rank],
                             split_microbatches(x, m), split_microbatches(y, m))
    assert outer.activation_bytes == 0  # every backward released what its forward saved
    assert stats.peak_activation_bytes == outer.peak_activation_bytes > 0
    return stats, {n: q.grad for n, q in stage.named_parameters()}, tracer.events


@given(schedule=st.sampled_from(["gpipe", "1f1b", "interleaved"]), p=st.integers(1, 4),
       m=st.integers(1, 6), seed=st.integers(0, 99))
@budget(12)
def test_pipeline_gradients_equal_serial(schedule, p, m, seed):
    """GPipe and 1F1B take any m >= 1 -- m < p cuts 1F1B's warm-up short; interleaved needs m % p == 0."""
    chunks = 2 if schedule == "interleaved" else 1
    if schedule == "interleaved" and p < 2:
        p = 2
    if p * chunks > CFG.n_layer + 2:
        chunks = 1
    if schedule == "interleaved":
        m = p * ((m + 1) // 2)
    _check_against_serial(schedule, p, m, chunks, seed)


@pytest.mark.parametrize("schedule,p,m", [("gpipe", 4, 1), ("1f1b", 4, 1), ("1f1b", 4, 3), ("1f1b", 3, 2)])
def test_fewer_microbatches_than_stages(schedule, p, m):
    """m < p always runs (mostly bubble): 1F1B's warm-up is cut to min(p - s - 1, m) forwards."""
    _check_against_serial(schedule, p, m, 1, seed=m)


def _check_against_serial(schedule, p, m, chunks, seed, cfg=CFG):
    rng = np.random.default_rng(seed)
    x, y = rng.integers(0, 16, (2 * m, 4)), rng.integers(0, 16, (2 * m, 4))
    loss, want = _serial_grads(x, y, cfg)
    results = run(_pipeline_rank, ranks=p, schedule=schedule, m=m, chunks=chunks, x=x, y=y, cfg=cfg)
    got = {name: g for _, grads, _ in results for name, g in grads.items()}
    assert got.keys() == want.keys()  # every parameter lives on exactly one stage
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-12, err_msg=name)
    assert results[-1][0].loss == pytest.approx(loss, abs=1e-12)
    sched = make_schedule(schedule, p, m, chunks)
    for s, (stats, _, events) in enumerate(results):
        assert stats.peak_microbatches == peak_activations(sched[s])
        computes = [e for e in events if e["cat"] == "compute"]
        assert {(e["name"], e["args"]["mb"], e["args"]["chunk"]) for e in computes} == \
            {(k, mb, c) for k in ("Forward", "Backward") for mb in range(m) for c in range(chunks)}


@pytest.mark.parametrize("p,m,chunks", [(3, 3, 2), (3, 6, 2), (4, 4, 2), (4, 8, 2), (3, 6, 1)])
def test_interleaved_on_a_deeper_model_equals_serial(p, m, chunks):
    """Interleaving at p = 3 and 4 with enough layers for every virtual stage (8 layers: embedding,
    6 blocks, head), so chunks > 1 is really exercised (the default 5-layer model falls back to 1)."""
    _check_against_serial("interleaved", p, m, chunks, seed=p + m, cfg=CFG.replace(n_layer=6))


def test_one_f_one_b_holds_fewer_activations_than_gpipe():
    p, m = 3, 6
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 16, (m, 4)), rng.integers(0, 16, (m, 4))
    gp = run(_pipeline_rank, ranks=p, schedule="gpipe", m=m, chunks=1, x=x, y=y)
    ob = run(_pipeline_rank, ranks=p, schedule="1f1b", m=m, chunks=1, x=x, y=y)
    for s in range(p):
        assert gp[s][0].peak_microbatches == m and ob[s][0].peak_microbatches == min(m, p - s)
        per_mb = gp[s][0].activation_bytes[(0, 0)]
        assert gp[s][0].peak_activation_bytes == m * per_mb
        assert ob[s][0].peak_activation_bytes == min(m, p - s) * per_mb
    for s in range(p):  # each stage computed in exactly its schedule's order, one op at a time
        computes = sorted((e for e in ob[s][2] if e["cat"] == "compute"), key=lambda e: e["t0"])
        want = [(type(i).__name__, i.mb) for i in one_f_one_b(p, m)[s] if isinstance(i, (Forward, Backward))]
        assert [(e["name"], e["args"]["mb"]) for e in computes] == want
        assert all(a["t1"] <= b["t0"] for a, b in zip(computes, computes[1:]))


def test_stage_errors():
    model = GPT(CFG)
    with pytest.raises(ValueError, match="at most 5 stages"):
        partition_uniform(len(model), 6)

    def wrong_group(comm):
        stage = PipelineStage(model, partition_uniform(len(model), 3), 0, 3)
        run_schedule(stage, comm, [], [None], [None])
    with pytest.raises(ValueError, match="pipeline group has 2 ranks but the model is cut into 3 stages"):
        run(wrong_group, ranks=2)

    def wrong_weights(comm):
        stage = PipelineStage(model, partition_uniform(len(model), 1), 0, 1)
        x = np.zeros((2, 4), np.int64)
        run_schedule(stage, comm, [], [x, x], [x, x], loss_weights=[1.0])
    with pytest.raises(ValueError, match="1 loss_weights for 2 microbatches; give one weight per microbatch"):
        run(wrong_weights, ranks=1)


# -- the simulator at measured op costs ---------------------------------------------------------------

HAND_COSTS = {(0, "Forward"): 1.0, (0, "Backward"): 2.0, (1, "Forward"): 3.0, (1, "Backward"): 4.0}


@pytest.mark.parametrize("buffered, starts, makespan", [
    # background sends (the runtime's isend): a message is in flight from its send on, so stage 1's
    # F1 starts at 8.5 (its input arrived at 2 + 0.5 while B0 ran), and stage 0 never waits to send
    (True, {(0, "Forward", 0): 0.0, (0, "Forward", 1): 1.0, (1, "Forward", 0): 1.5, (1, "Backward", 0): 4.5,
            (0, "Backward", 0): 9.0, (1, "Forward", 1): 8.5, (1, "Backward", 1): 11.5,
            (0, "Backward", 1): 16.0}, 18.0),
    # rendezvous: a send and its receive both end at max(posted) + 0.5; stage 0's SendAct(1) waits
    # until stage 1 posts RecvAct(1) at 8.5, so everything after it slides by 0.5 to 1
    (False, {(0, "Forward", 0): 0.0, (0, "Forward", 1): 1.5, (1, "Forward", 0): 1.5, (1, "Backward", 0): 4.5,
             (0, "Backward", 0): 9.5, (1, "Forward", 1): 9.5, (1, "Backward", 1): 12.5,
             (0, "Backward", 1): 17.0}, 19.0),
])
def test_simulate_with_each_ops_own_cost_by_hand(buffered, starts, makespan):
    """`op_time(stage, instr)`: 1F1B, p = 2, m = 2, stage 0's F = 1 and B = 2, stage 1's F = 3 and
    B = 4, each message 0.5. Worked on paper: stage 0 runs F0 [0, 1], F1 [1, 2]; stage 1 gets act 0
    at 1.5, F0 [1.5, 4.5], B0 [4.5, 8.5], sends grad 0 (at stage 0 by 9); B0 on stage 0 [9, 11]; ...
    Busy 1+1+2+2 + 3+4+3+4 = 20 of 2 x makespan: bubble 1 - 20/36 = 4/9 (buffered), 1 - 20/38."""
    res = simulate(make_schedule("1f1b", 2, 2), op_time=lambda s, i: HAND_COSTS[(s, type(i).__name__)],
                   comm_time=0.5, buffered_sends=buffered)
    got = {(e["rank"], e["name"], e["args"]["mb"]): e["t0"] for e in res.events if e["cat"] == "compute"
           and e["name"] != "OptimizerStep"}
    assert got == starts
    assert res.makespan == makespan and res.bubble == pytest.approx(1 - 20 / (2 * makespan), abs=1e-12)


def test_measured_costs_give_back_each_spans_duration():
    """`measured_costs(events)`: the spans of a run (here the simulated one above, stage = rank) become
    `op_time` again: each op its own duration, so simulating with them reproduces the run exactly;
    an op the spans lack is a KeyError naming it."""
    sched = make_schedule("zb-h1", 3, 4)
    first = simulate(sched, op_time=lambda s, i: 1.0 + s + 0.25 * i.mb + 0.5 * isinstance(i, Forward),
                     comm_time=0.125, buffered_sends=True)
    again = simulate(sched, op_time=measured_costs(first.events), comm_time=0.125, buffered_sends=True)
    assert again.makespan == first.makespan and again.bubble == first.bubble
    lookup = measured_costs([e for e in first.events if e["args"].get("mb") != 3])
    with pytest.raises(KeyError, match="'Forward', 3"):
        lookup(0, Forward(3))


def test_the_device_model_prices_a_split_backwards_b_and_w():
    """Under a device model every op of B and of W is priced (FLOPs and bytes from its shapes): each
    part costs between a third and two thirds of the whole backward, and B + W at least the whole
    (W reads the output gradients again), at most 1.5x. Found unpriced: B and W took no time at all,
    and ZB-H1 ran as if it had no backward."""
    from minidist.comm.clock import Device, RankClock
    from minidist.parallel.pipeline.split_backward import backward_input

    model = GPT(CFG.replace(dtype="float32", d_model=16, block_size=8))
    x = np.zeros((2, 8), np.int64)
    clock = RankClock(device=Device(1e9, 1e9, 1e-6))
    clock.adopt_thread()
    try:
        out = model(x)
        seed = np.ones(out.shape, out.dtype)
        t0 = clock.now()
        out.backward(seed)
        whole = clock.now() - t0
        out = model(x)
        t0 = clock.now()
        queue = backward_input(out, seed, inputs=[])
        b = clock.now() - t0
        queue.run()
        w = clock.now() - t0 - b
    finally:
        RankClock.release_thread()
    assert whole > 0 and whole / 3 < b < 2 * whole / 3 and whole / 3 < w < 2 * whole / 3
    assert whole <= b + w <= 1.5 * whole


# -- under real mpirun -------------------------------------------------------------------------------

@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun (pip install mpich)")
@pytest.mark.timeout(60)
def test_lesson_under_mpirun_8_passes_its_check():
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("MINIDIST_TRANSPORT", None)
    cmd = ["mpirun", "-n", "8", sys.executable, "-m", "minidist.lessons.pipeline", "--steps", "3",
           "--width", "64", "--seq", "32"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=50, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "(mpi) = dp 2 x pp 4 x tp 1" in res.stdout
    assert re.search(r"serial twin .* PASS", res.stdout), res.stdout
    assert res.stdout.count("stage 3 |") == 1 and "formula (p-1)/(m+p-1) = 3/11" in res.stdout


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun (pip install mpich)")
@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule, checks", [
    ("1f1b", [r"1F1B's bubble [0-9.]+ within 0.03 of \(p-1\)/\(m\+p-1\) = 0.429  PASS"]),
    ("zb-h1", [r"ZB-H1's bubble [0-9.]+ within 0.03 of its simulator's [0-9.]+  PASS",
               r"ZB-H1's bubble [0-9.]+ below 1F1B's [0-9.]+ .*PASS"]),
])
def test_lesson_under_mpirun_8_on_the_virtual_clock(schedule, checks):
    """mpirun -n 8 (dp 2 x pp 4, m = 4), each process its own rank clock, ops priced by a device
    model: the lesson's virtual-clock checks PASS, and the bubble it measures equals what the same
    flags give on 8 thread ranks (the virtual clock does not depend on the transport or the load)."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               MINIDIST_DEVICE="tflops=0.0001,gBps=50,overhead_us=0,name=test device")
    env.pop("MINIDIST_TRANSPORT", None)
    flags = ["--clock", "virtual", "--schedule", schedule, "--steps", "2", "--width", "128", "--seq", "8",
             "--layers", "8", "--partition", "blocks", "--batch", "16", "--microbatches", "4"]
    outs = []
    for launcher in (["mpirun", "-n", "8", sys.executable], [sys.executable]):
        extra = [] if launcher[0] == "mpirun" else ["--ranks", "8"]
        res = subprocess.run([*launcher, "-m", "minidist.lessons.pipeline", *flags, *extra],
                             capture_output=True, text=True, timeout=200, env=env, cwd=ROOT)
        assert res.returncode == 0, res.stdout + res.stderr
        outs.append(res.stdout)
    assert "(mpi) = dp 2 x pp 4 x tp 1" in outs[0]
    for pattern in checks:
        assert re.search(pattern, outs[0]), outs[0]
    bubble = [re.search(r"measured ([0-9.]+) \(median", out).group(1) for out in outs]
    assert bubble[0] == bubble[1], bubble
