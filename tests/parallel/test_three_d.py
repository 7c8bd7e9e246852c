"""3D parallelism (dp x pp x tp on a Mesh) trains to the same parameters as the serial GPT."""

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from minidist.comm import run
from minidist.lessons.pipeline import main as lesson_main
from minidist.nn import GPTConfig
from minidist.parallel.three_d import check_3d, gather_full_state, max_state_diff, train_3d, train_serial
from tests.conftest import budget

CFG = GPTConfig(vocab_size=16, block_size=4, n_layer=2, n_head=2, d_model=8, dtype="float64")
TOL = 1e-9  # float64; only the summation order differs (microbatch and replica partial sums)


def _batches(rows, steps=2, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 16, (rows, 4)), rng.integers(0, 16, (rows, 4))) for _ in range(steps)]


def _rank(comm, batches, optimizer, **kw):
    result = train_3d(comm, CFG, batches, lr=0.1, optimizer=optimizer, **kw)
    return gather_full_state(comm, result), result.losses


def _check(dp, pp, tp, m, schedule, optimizer="sgd", seed=0, chunks=1, recompute=None, ignore=False):
    batches = (_ignored_batches if ignore else _batches)(dp * m * 2, seed=seed)
    want, want_losses = train_serial(CFG, batches, lr=0.1, optimizer=optimizer)
    results = run(_rank, ranks=dp * pp * tp, batches=batches, optimizer=optimizer, dp=dp, pp=pp, tp=tp,
                  microbatches=m, schedule=schedule, chunks=chunks, recompute=recompute)
    state, losses = results[0]
    assert max_state_diff(state, want) <= TOL
    np.testing.assert_allclose(losses, want_losses, rtol=0, atol=TOL)
    assert all(r[0] is None for r in results[1:])  # the full model is gathered on rank 0 only


@pytest.mark.parametrize("dp,pp,tp", [(2, 2, 2), (2, 4, 1), (1, 4, 2)])
def test_eight_ranks_equal_serial(dp, pp, tp):
    _check(dp, pp, tp, m=2, schedule="1f1b", optimizer="adamw")


@pytest.mark.parametrize("policy", ["full", "sqrt", "selective"])
def test_3d_with_activation_recomputation_equals_serial(policy):
    _check(2, 2, 2, m=2, schedule="1f1b", recompute=policy)


def test_interleaved_2x2x2_equals_serial():
    _check(2, 2, 2, m=2, schedule="interleaved", chunks=2)


@given(dp=st.integers(1, 2), pp=st.integers(1, 4), tp=st.sampled_from([1, 2]), m=st.integers(1, 4),
       schedule=st.sampled_from(["gpipe", "1f1b"]), seed=st.integers(0, 9), ignore=st.booleans())
@budget(10)
@example(dp=1, pp=3, tp=1, m=5, schedule="1f1b", seed=1, ignore=True)   # p = 3, m not a multiple of p
@example(dp=2, pp=3, tp=1, m=2, schedule="gpipe", seed=2, ignore=True)  # 6 ranks, m < p
@example(dp=1, pp=3, tp=2, m=3, schedule="1f1b", seed=3, ignore=False)
def test_random_meshes_equal_serial(dp, pp, tp, m, schedule, seed, ignore):
    """``ignore``: targets of -1 spread unevenly over the rows (see ``_ignored_batches``)."""
    _check(dp, pp, tp, m, schedule, seed=seed, ignore=ignore)


def test_errors_before_any_communication():
    with pytest.raises(ValueError, match="dp=2 x pp=2 x tp=1 = 4 ranks, but the world has 6"):
        check_3d(6, CFG, 8, 2, 2, 1, 2)
    with pytest.raises(ValueError, match="5 pipeline stages .* only 4 layers"):
        check_3d(5, CFG, 8, 1, 5, 1, 1)
    with pytest.raises(ValueError, match="global batch 6 does not split into dp=2 replicas x 2 microbatches"):
        check_3d(4, CFG, 6, 2, 2, 1, 2)
    with pytest.raises(ValueError, match="n_head=2 is not divisible by tp=4"):
        check_3d(4, CFG, 8, 1, 1, 4, 1)

    def bad(comm):
        train_3d(comm, CFG, _batches(6), dp=2, pp=1, microbatches=2)
    with pytest.raises(ValueError, match="multiple of 4"):
        run(bad, ranks=2)


def test_lesson_on_threads(capsys):
    lesson_main(["--ranks", "4", "--dp", "1", "--tp", "2", "--steps", "2", "--width", "32", "--seq", "16",
                 "--layers", "2", "--microbatches", "4", "--batch", "8", "--schedule", "gpipe",
                 "--partition", "params"])
    out = capsys.readouterr().out
    assert "dp 1 x pp 2 x tp 2" in out and "PASS" in out and "FAIL" not in out
    assert "stage 1 |" in out and "formula (p-1)/(m+p-1) = 1/5" in out


def _ignored_batches(rows, steps=2, seed=0):
    """Targets of -1 (ignored) spread unevenly: row r ignores its first r % 4 positions, and the
    last row ignores every position, so microbatches and replicas count different numbers of tokens."""
    batches = _batches(rows, steps, seed)
    for _, y in batches:
        for r in range(rows):
            y[r, :r % 4] = -1
        y[-1] = -1
    return batches


@pytest.mark.parametrize("dp,pp,tp,m,schedule", [(2, 2, 1, 2, "1f1b"), (1, 2, 1, 4, "gpipe"),
                                                  (2, 1, 2, 2, "1f1b"), (2, 2, 1, 2, "interleaved")])
def test_ignored_targets_give_the_serial_token_mean(dp, pp, tp, m, schedule):
    """The serial loss is the mean over the global batch's valid tokens: a microbatch (and a replica)
    with fewer valid tokens must weigh less, not the same 1/m (and 1/dp)."""
    _check(dp, pp, tp, m, schedule, chunks=2 if schedule == "interleaved" else 1, ignore=True)


def test_zero_with_a_pipeline_is_refused_naming_both():
    def body(comm):
        train_3d(comm, CFG, _batches(4), dp=2, pp=2, microbatches=2, zero=2)
    with pytest.raises(ValueError, match=r"pipeline \(PP\) cannot be combined with ZeRO-2: a PipelineStage"):
        run(body, ranks=4)


@pytest.mark.parametrize("zero", [1, 3])
def test_zero_instead_of_ddp_equals_serial_with_the_same_losses(zero):
    batches = _ignored_batches(4)
    want, want_losses = train_serial(CFG, batches, lr=0.1, optimizer="adamw")

    def body(comm):
        res = train_3d(comm, CFG, batches, dp=2, tp=2, microbatches=2, zero=zero, optimizer="adamw", lr=0.1)
        return gather_full_state(comm, res), res.losses
    state, losses = run(body, ranks=4)[0]
    assert max_state_diff(state, want) <= TOL
    np.testing.assert_allclose(losses, want_losses, rtol=0, atol=TOL)
