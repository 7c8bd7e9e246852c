"""The compiled SPMD program (minidist/parallel/spmd/program.py) equals minidist's eager dp x tp run,
and XLA emitted the collectives the algorithm calls for."""

from types import SimpleNamespace

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from minidist.comm import run  # noqa: E402
from minidist.nn import GPTConfig  # noqa: E402
from minidist.parallel.spmd import SPMDProgram, collective_counts, make_mesh, ring_all_reduce  # noqa: E402
from minidist.parallel.three_d import gather_full_state, max_state_diff, train_3d, train_serial  # noqa: E402

# the device-transport test's model and batch rows: JAX's per-device compile cache is shared
CFG = GPTConfig(vocab_size=16, block_size=4, n_layer=1, n_head=2, d_model=8, dtype="float64")
TOL = 1e-9  # float64: only the summation order differs (ring chunks, tp partial sums)


def _batches(steps=2):
    rng = np.random.default_rng(1)
    batches = [(rng.integers(0, 16, (4, 4)), rng.integers(0, 16, (4, 4))) for _ in range(steps)]
    batches[1][1][0, :3] = -1  # ignored targets, unevenly over the dp rows
    return batches


@pytest.fixture(scope="module")
def spmd_run():
    spmd = SPMDProgram(CFG, dp=2, tp=2, lr=0.1, dp_reduce="ring")
    losses = [spmd.step(x, y) for x, y in _batches()]
    return spmd, losses


def test_the_program_equals_the_eager_run_on_the_device_transport(spmd_run):
    spmd, losses = spmd_run

    def body(comm):
        res = train_3d(comm, CFG, _batches(), dp=2, pp=1, tp=2, lr=0.1, optimizer="sgd")
        return gather_full_state(comm, res), res.losses

    eager_state, eager_losses = run(body, ranks=4, transport="jax")[0]
    assert max_state_diff(spmd.state(), eager_state) <= TOL
    np.testing.assert_allclose(losses, eager_losses, rtol=0, atol=TOL)
    want, want_losses = train_serial(CFG, _batches(), lr=0.1)  # and both equal the serial twin
    assert max_state_diff(spmd.state(), want) <= TOL
    np.testing.assert_allclose(losses, want_losses, rtol=0, atol=TOL)


def test_shard_diff_compares_each_shard_with_its_piece_of_the_full_state(spmd_run):
    """What each process checks across hosts: its shards against the same pieces of a full state.
    One process holds every shard here, so a change anywhere -- in one tp half of a split weight
    -- must show, and the state itself differs by nothing."""
    spmd, _ = spmd_run
    state = spmd.state()
    assert spmd.shard_diff(state) == 0.0
    name = "1.mlp.fc.weight"  # column-parallel: tp rank 1 holds the second half of the columns
    bumped = dict(state, **{name: state[name].copy()})
    bumped[name][0, -1] += 0.25
    assert spmd.shard_diff(bumped) == pytest.approx(0.25, abs=1e-6)


def test_xla_emitted_the_collectives_of_the_algorithm(spmd_run):
    spmd, _ = spmd_run
    counts = collective_counts(spmd.compiled_text(*_batches()[0]))
    # the ring over dp=2: p-1 reduce-scatter + p-1 all-gather steps, one collective-permute each
    assert counts["collective-permute"] == 2 * (2 - 1)
    # Megatron: per layer g (forward) and f (backward) for attention and MLP = 4, plus the loss's psum
    assert counts["all-reduce"] == 4 * CFG.n_layer + 1
    assert counts["all-gather"] == 0


def test_ring_all_reduce_with_ppermute_sums_over_the_axis():
    from jax.sharding import PartitionSpec as P

    p, n = 4, 10  # 10 elements do not split into 4 chunks: padded
    mesh = make_mesh(p, 1)
    x = np.arange(p * n, dtype=np.float64).reshape(p, n) ** 2
    fn = jax.jit(jax.shard_map(lambda a: ring_all_reduce(a, "dp", p), mesh=mesh, in_specs=P("dp"),
                               out_specs=P("dp"), check_vma=False))
    out = np.asarray(fn(x))
    want = sum(x[r] for r in range(p))  # every row of the result is the sum of the rows
    for r in range(p):
        np.testing.assert_array_equal(out[r], want)
    assert collective_counts(fn.lower(x).compile().as_text())["collective-permute"] == 2 * (p - 1)


def test_errors_say_what_would_be_right():
    with pytest.raises(ValueError, match="n_head=2 is not divisible by tp=4"):
        SPMDProgram(CFG, dp=1, tp=4)
    with pytest.raises(ValueError, match="dp_reduce='tree'"):
        SPMDProgram(CFG, dp=2, tp=1, dp_reduce="tree")
    with pytest.raises(ValueError, match=r"multi-head attention only \(n_kv_head=1 < n_head=2\)"):
        SPMDProgram(CFG.replace(n_kv_head=1), dp=2, tp=1)


@pytest.mark.parametrize("off,code", [(0.0, 0), (1e-3, 1)])
def test_tpu_lesson_checks_the_two_runs_and_exits_nonzero_on_fail(monkeypatch, capsys, off, code):
    """The lesson's check and report, on stand-in runs (the real pair is the test above): equal
    parameters PASS with exit 0, a 1e-3 difference FAILs with exit 1."""
    from minidist.lessons import tpu

    state = {"w": np.ones((2, 2))}
    monkeypatch.setattr(tpu, "eager", lambda cfg, batches, args: (
        state, [3.0, 2.0], [1.0, 0.1], {"ring_all_reduce": 8}, 64, ["cpu:0", "cpu:1"]))
    spmd = SimpleNamespace(state=lambda: {"w": state["w"] + off}, mesh=make_mesh(2, 1))
    monkeypatch.setattr(tpu, "compiled", lambda cfg, batches, args: (
        spmd, [3.0, 2.0], [2.0, 0.01], {"all-reduce": 5, "collective-permute": 2}))
    assert tpu.main(["--dp", "2", "--tp", "1", "--steps", "2", "--dtype", "float64"]) == code
    out = capsys.readouterr().out
    assert ("PASS" if code == 0 else "FAIL") + ": eager minidist == compiled program" in out
    assert "rank 1 -> cpu:1" in out and "collective-permute" in out and "10.0x" in out  # 100 ms / 10 ms


def test_tpu_lesson_plots_both_runs(monkeypatch, capsys, tmp_path):
    """--plot draws the stand-in runs' losses and step times into a PNG and says where."""
    from minidist.lessons import tpu

    state = {"w": np.ones((2, 2))}
    monkeypatch.setattr(tpu, "eager", lambda cfg, batches, args: (
        state, [3.0, 2.0], [1.0, 0.1], {}, 0, ["cpu:0", "cpu:1"]))
    spmd = SimpleNamespace(state=lambda: state, mesh=make_mesh(2, 1))
    monkeypatch.setattr(tpu, "compiled", lambda cfg, batches, args: (spmd, [3.0, 2.0], [2.0, 0.01], {}))
    out = tmp_path / "tpu.png"
    assert tpu.main(["--dp", "2", "--tp", "1", "--steps", "2", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"plot drawn to {out}" in capsys.readouterr().out


@pytest.mark.parametrize("cache", ["/tmp/somewhere", "0"])
def test_tpu_lesson_says_why_the_first_eager_step_is_slow_before_it_starts(monkeypatch, capsys, cache):
    """The first eager step on 8 CPU devices is a silent minute of compiles: a line, printed (and
    flushed) before it starts, says so and where later runs find them (or that the cache is off)."""
    from minidist.lessons import tpu

    monkeypatch.setenv("MINIDIST_JAX_CACHE", cache)
    seen = []

    def eager(cfg, batches, args):
        seen.append(capsys.readouterr().out)  # what the student has read when step 0 starts
        return {"w": np.ones(1)}, [1.0], [0.1], {}, 0, ["cpu:0", "cpu:1"]

    monkeypatch.setattr(tpu, "eager", eager)
    monkeypatch.setattr(tpu, "compiled", lambda cfg, batches, args: (
        SimpleNamespace(state=lambda: {"w": np.ones(1)}, mesh=make_mesh(2, 1)), [1.0], [0.01], {}))
    assert tpu.main(["--dp", "2", "--tp", "1", "--steps", "1", "--dtype", "float64"]) == 0
    note = seen[0].strip().splitlines()[-1]
    assert note.startswith("eager minidist: its step 0 compiles each op once per device (2 devices")
    assert note.endswith("later runs load them from the cache (/tmp/somewhere)" if cache != "0" else
                         "MINIDIST_JAX_CACHE=0: no cache, so every run compiles them again")


@pytest.mark.parametrize("argv,dp,tp,batch", [
    ([], 4, 2, 4), (["--tp", "4"], 1, 4, 4), (["--dp", "8"], 8, 1, 8), (["--dp", "3", "--tp", "2"], 3, 2, 6)])
def test_tpu_lesson_mesh_and_batch_follow_the_devices(monkeypatch, argv, dp, tp, batch):
    """No --dp/--tp: the mesh is default_shape(8 forced CPU devices) = 4 x 2; one flag given: the
    other is 1; the batch is 4 rows or the next multiple of dp. (Stand-in runs record the args.)"""
    from minidist.lessons import tpu

    seen = {}

    def stop(cfg, batches, args):
        seen.update(dp=args.dp, tp=args.tp, batch=args.batch, rows=[len(x) for x, _ in batches])
        raise StopIteration

    monkeypatch.setattr(tpu, "compiled", stop)
    with pytest.raises(StopIteration):
        tpu.main([*argv, "--steps", "2"])
    assert seen == {"dp": dp, "tp": tp, "batch": batch, "rows": [batch, batch]}


def test_tpu_lesson_refuses_a_mesh_larger_than_the_devices(capsys):
    from minidist.lessons import tpu

    with pytest.raises(SystemExit) as e:
        tpu.main(["--dp", "4", "--tp", "4"])
    assert e.value.code == 2 and "--dp 4 x --tp 4 = 16 devices, JAX sees 8" in capsys.readouterr().err


@pytest.mark.parametrize("env,per,flags", [
    ({}, 8, "--xla_force_host_platform_device_count=8"),
    ({"PMI_SIZE": "2"}, 4, "--xla_force_host_platform_device_count=4"),           # mpirun -n 2 (MPICH)
    ({"OMPI_COMM_WORLD_SIZE": "16"}, 1, "--xla_force_host_platform_device_count=1"),  # Open MPI, 16 > 8
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=1", "PMI_SIZE": "2"}, 1,
     "--xla_force_host_platform_device_count=1"),                                 # the user's choice wins
    ({"XLA_FLAGS": "--xla_cpu_use_thunk_runtime=false", "PMI_SIZE": "4"}, 2,
     "--xla_cpu_use_thunk_runtime=false --xla_force_host_platform_device_count=2"),  # other flags kept
])
def test_tpu_lesson_forces_8_cpu_devices_for_the_whole_job(env, per, flags):
    from minidist.lessons.tpu import force_cpu_devices

    assert force_cpu_devices(env) == per and env["XLA_FLAGS"] == flags


@pytest.mark.mpi
@pytest.mark.parametrize("per,dp,tp,mesh", [
    (4, 2, 2, ["cpu:0@0  cpu:1@0", "cpu:2048@1  cpu:2049@1"]),  # dp across the processes, tp inside each
    (1, 1, 2, ["cpu:0@0  cpu:2048@1"]),                          # tp across the process boundary
], ids=["dp-across", "tp-across"])
def test_tpu_lesson_under_mpirun_spans_both_processes(per, dp, tp, mesh):
    """Multi-controller JAX for real: mpirun -n 2, jax.distributed.initialize over gloo, the program's
    mesh on both processes' devices, each process checking its own parameter shards; exit 0 and
    PASS from process 0 only. (A mesh of the first dp*tp devices left process 1 without one: it
    crashed reading the loss.)

    Measured cold (MINIDIST_JAX_CACHE=0, or a fresh HOME), both meshes: 3.8-9.0 s, median ~6.2 s,
    over ~20 runs at load 2-5 on 2 cores (imports, gloo, step 0's ~4 s compile). The limit is 120 s,
    13x the worst. A run that stalled after its PASS was the XLA client's teardown at interpreter
    exit (``run_lesson`` now ends the process without it); a run past the limit fails with what the
    processes printed by then (unbuffered), so the next one shows where it stalled, and mpirun's
    whole process group is killed (no orphans left to load the rest of the suite)."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]),
               XLA_FLAGS=f"--xla_force_host_platform_device_count={per}", PYTHONUNBUFFERED="1")
    env.pop("MINIDIST_TRANSPORT", None)
    cmd = ["mpirun", "-n", "2", sys.executable, "-m", "minidist.lessons.tpu", "--dp", str(dp),
           "--tp", str(tp), "--steps", "2", "--layers", "1", "--seq", "8", "--d-model", "16"]
    t0, limit = time.monotonic(), 120
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"mpirun -n 2 ran past {limit} s (load {os.getloadavg()[0]:.1f}); "
                    f"it printed:\n{out}{err}")
    res = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    print(f"mpirun -n 2 took {time.monotonic() - t0:.1f} s")
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"JAX {jax.__version__}: {2 * per} devices, platform cpu, kind 'cpu', 2 process(es)" in res.stdout
    assert res.stdout.count("PASS: compiled program == serial twin after 2 steps") == 1, res.stdout  # proc 0
    # gloo's C++ prints its connection notes into the same stdout, pieces of them between our lines
    # (one CI run: between the mesh's rows); take them out before matching the mesh
    import re

    ours = re.sub(r"\[Gloo\] Rank |\d+ is connected to \d+ peer ranks\. Expected number of connected peer "
                  r"ranks is : \d+\n?", "", res.stdout)
    assert f"mesh ('dp', 'tp') = {dp} x {tp}, device@process:\n" + "".join(f"   {row}\n" for row in mesh) \
        in ours, res.stdout


def test_the_compiled_program_multiplies_float32_in_full_precision_in_a_fresh_process():
    """The spmd sets up JAX as the backend does: float64 on, float32 matmuls at full precision (by
    default a GPU uses TF32 and a TPU bf16 passes: ~1e-3 off the eager run). A fresh process, since
    this one's JAX was already set up by the backend."""
    import os
    import subprocess
    import sys

    code = ("from minidist.parallel import spmd\njax = spmd._jax()\n"
            "print(jax.config.jax_enable_x64, jax.config.jax_default_matmul_precision)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "highest"]
