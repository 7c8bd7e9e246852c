"""The compiled SPMD twin (minidist/spmd.py) equals minidist's eager dp x tp run, and XLA emitted
the collectives the algorithm calls for."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from minidist.comm import run  # noqa: E402
from minidist.nn import GPTConfig  # noqa: E402
from minidist.parallel.three_d import gather_full_state, max_state_diff, train_3d, train_serial  # noqa: E402
from minidist.spmd import SPMDTwin, collective_counts, make_mesh, ring_all_reduce  # noqa: E402

# the device-transport test's model and batch rows: JAX's per-device compile cache is shared
CFG = GPTConfig(vocab_size=16, block_size=4, n_layer=1, n_head=2, d_model=8, dtype="float64")
TOL = 1e-9  # float64: only the summation order differs (ring chunks, tp partial sums)


def _batches(steps=2):
    rng = np.random.default_rng(1)
    batches = [(rng.integers(0, 16, (4, 4)), rng.integers(0, 16, (4, 4))) for _ in range(steps)]
    batches[1][1][0, :3] = -1  # ignored targets, unevenly over the dp rows
    return batches


@pytest.fixture(scope="module")
def twin_run():
    twin = SPMDTwin(CFG, dp=2, tp=2, lr=0.1, dp_reduce="ring")
    losses = [twin.step(x, y) for x, y in _batches()]
    return twin, losses


def test_twin_equals_the_eager_run_on_the_device_transport(twin_run):
    twin, losses = twin_run

    def body(comm):
        res = train_3d(comm, CFG, _batches(), dp=2, pp=1, tp=2, lr=0.1, optimizer="sgd")
        return gather_full_state(comm, res), res.losses

    eager_state, eager_losses = run(body, ranks=4, transport="jax")[0]
    assert max_state_diff(twin.state(), eager_state) <= TOL
    np.testing.assert_allclose(losses, eager_losses, rtol=0, atol=TOL)
    want, want_losses = train_serial(CFG, _batches(), lr=0.1)  # and both equal the serial twin
    assert max_state_diff(twin.state(), want) <= TOL
    np.testing.assert_allclose(losses, want_losses, rtol=0, atol=TOL)


def test_xla_emitted_the_collectives_of_the_algorithm(twin_run):
    twin, _ = twin_run
    counts = collective_counts(twin.compiled_text(*_batches()[0]))
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
        SPMDTwin(CFG, dp=1, tp=4)
    with pytest.raises(ValueError, match="needs 16 devices, JAX sees 8"):
        make_mesh(4, 4)
    with pytest.raises(ValueError, match="dp_reduce='tree'"):
        SPMDTwin(CFG, dp=2, tp=1, dp_reduce="tree")



@pytest.mark.parametrize("off,code", [(0.0, 0), (1e-3, 1)])
def test_tpu_lesson_checks_the_two_runs_and_exits_nonzero_on_fail(monkeypatch, capsys, off, code):
    """The lesson's check and report, on stand-in runs (the real pair is the test above): equal
    parameters PASS with exit 0, a 1e-3 difference FAILs with exit 1."""
    from minidist.lessons import tpu

    state = {"w": np.ones((2, 2))}
    monkeypatch.setattr(tpu, "eager", lambda cfg, batches, args: (
        state, [3.0, 2.0], [1.0, 0.1], {"ring_all_reduce": 8}, 64, ["cpu:0", "cpu:1"]))
    monkeypatch.setattr(tpu, "compiled", lambda cfg, batches, args: (
        {"w": state["w"] + off}, [3.0, 2.0], [2.0, 0.01], {"all-reduce": 5, "collective-permute": 2},
        make_mesh(2, 1)))
    assert tpu.main(["--dp", "2", "--tp", "1", "--steps", "2", "--dtype", "float64"]) == code
    out = capsys.readouterr().out
    assert ("PASS" if code == 0 else "FAIL") + ": eager minidist == compiled twin" in out
    assert "rank 1 -> cpu:1" in out and "collective-permute" in out and "10.0x" in out  # 100 ms / 10 ms
