"""Training over any mesh dp x pp x cp x tp equals the serial GPT; the Mesh's rank order and groups."""

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from minidist.comm import Mesh, run
from minidist.nn import GPTConfig
from minidist.parallel.experts.serial import train_serial_moe
from minidist.parallel.three_d import (
    Options,
    check,
    check_3d,
    gather_full_state,
    max_state_diff,
    train_mesh,
    train_serial,
)
from tests.conftest import budget

CFG = GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, d_model=8, dtype="float64")
TOL = 1e-9  # float64; only the summation order differs (microbatch, replica and token partial sums)


def _batches(rows, seq=8, steps=2, seed=0, ignore=False):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        y = rng.integers(0, 16, (rows, seq))
        if ignore:  # ignored targets spread unevenly over rows and positions
            y = np.where(rng.random((rows, seq)) < 0.3, -1, y)
        out.append((rng.integers(0, 16, (rows, seq)), y))
    return out


def _rank(comm, batches, **kw):
    result = train_mesh(comm, CFG, batches, lr=0.1, **kw)
    return gather_full_state(comm, result), result.losses


def _check(dp, pp, cp, tp, m=1, seed=0, optimizer="sgd", ignore=False, layout="zigzag", schedule="1f1b",
           recompute=None):
    batches = _batches(dp * m, seed=seed, ignore=ignore)
    want, want_losses = train_serial(CFG, batches, lr=0.1, optimizer=optimizer)
    results = run(_rank, ranks=dp * pp * cp * tp, batches=batches, dp=dp, pp=pp, cp=cp, tp=tp,
                  microbatches=m, optimizer=optimizer, layout=layout, schedule=schedule,
                  checkpoint=recompute)  # the old name of recompute=, still accepted
    state, losses = results[0]
    assert max_state_diff(state, want) <= TOL
    np.testing.assert_allclose(losses, want_losses, rtol=0, atol=TOL)


@pytest.mark.parametrize("dp,pp,cp,tp", [(1, 1, 4, 1), (2, 1, 2, 2), (1, 2, 2, 2)])
def test_context_parallel_meshes_equal_serial(dp, pp, cp, tp):
    _check(dp, pp, cp, tp, m=2, optimizer="adamw")


def test_context_parallel_with_full_recomputation_equals_serial():
    _check(1, 2, 2, 1, m=2, recompute="full")


@given(dp=st.sampled_from([1, 2]), pp=st.sampled_from([1, 2]), cp=st.sampled_from([1, 2, 4]),
       tp=st.sampled_from([1, 2]), m=st.integers(1, 2), seed=st.integers(0, 9), ignore=st.booleans(),
       layout=st.sampled_from(["zigzag", "contiguous"]))
@budget(6)
@example(dp=2, pp=1, cp=4, tp=1, m=1, seed=1, ignore=True, layout="zigzag")
@example(dp=1, pp=2, cp=2, tp=2, m=2, seed=2, ignore=False, layout="contiguous")
def test_meshes_of_eight_ranks_equal_serial(dp, pp, cp, tp, m, seed, ignore, layout):
    """Any dp x pp x cp x tp with product 8 (threads) trains to the serial twin's parameters."""
    if dp * pp * cp * tp != 8:
        cp = 8 // (dp * pp * tp)
        if cp not in (1, 2, 4):
            return
    _check(dp, pp, cp, tp, m, seed=seed, ignore=ignore, layout=layout)


@given(dp=st.sampled_from([2, 4]), pp=st.sampled_from([1, 2]), cp=st.sampled_from([1, 2]),
       tp=st.sampled_from([1, 2]), ep=st.sampled_from([1, 2, 4]), k=st.integers(1, 2), m=st.integers(1, 2),
       seed=st.integers(0, 9))
@budget(5)
@example(dp=2, pp=2, cp=1, tp=2, ep=2, k=2, m=2, seed=0)
@example(dp=4, pp=1, cp=2, tp=1, ep=4, k=1, m=1, seed=1)
def test_moe_meshes_of_eight_ranks_equal_serial(dp, pp, cp, tp, ep, k, m, seed):
    """Every block's MLP a mixture of 4 experts split over ep groups carved from dp (no drops)."""
    if dp * pp * cp * tp != 8:
        pp = 8 // (dp * cp * tp) if 8 % (dp * cp * tp) == 0 else 0
        if pp not in (1, 2, 4):
            return
    ep = min(ep, dp)
    moe = dict(n_experts=4, k=k, seed=seed)
    batches = _batches(dp * m, seed=seed)
    want, want_losses = train_serial_moe(CFG, batches, moe, lr=0.1)
    results = run(_rank, ranks=8, batches=batches, dp=dp, pp=pp, cp=cp, tp=tp, ep=ep, microbatches=m, moe=moe)
    state, losses = results[0]
    assert max_state_diff(state, want) <= TOL
    np.testing.assert_allclose(losses, want_losses, rtol=0, atol=TOL)


def test_rank_order_is_pp_dp_cp_tp_and_groups_follow_it():
    def body(comm):
        m = Mesh(comm, dp=2, pp=1, tp=2, cp=2, ep=2)
        assert m.rank_of(m.pp_rank, m.dp_rank, m.tp_rank, m.cp_rank) == comm.rank
        names = ("tp", "cp", "dp", "ep", "edp", "dp_cp", "edp_cp", "pp")
        return (m.dp_rank, m.cp_rank, m.tp_rank), {g: m.group(g).allgather_obj(comm.rank) for g in names}

    out = run(body, ranks=8)
    assert out[5][0] == (1, 0, 1)  # 5 = ((0*2 + 1)*2 + 0)*2 + 1
    assert out[5][1] == {"tp": [4, 5], "cp": [5, 7], "dp": [1, 5], "ep": [1, 5], "edp": [5],
                         "dp_cp": [1, 3, 5, 7], "edp_cp": [5, 7], "pp": [5]}


def test_mesh_draws_every_rank_at_its_place():
    text = run(lambda comm: Mesh(comm, dp=2, pp=2, tp=2).draw(), ranks=8)[0]
    assert text.splitlines()[1:] == ["pp 0 | dp 0: 0 1 || dp 1: 2 3", "pp 1 | dp 0: 4 5 || dp 1: 6 7"]


def test_errors_before_any_communication():
    with pytest.raises(ValueError, match=r"dp=2 x pp=1 x cp=2 x tp=1 = 4 ranks, but the world has 8"):
        check_3d(8, CFG, 4, 2, 1, 1, 1, cp=2, seq_len=8)
    with pytest.raises(ValueError, match=r"length 6 does not split into 2 x cp = 4 .* multiple of 4"):
        check_3d(2, CFG, 4, 1, 1, 1, 1, cp=2, seq_len=6)
    with pytest.raises(ValueError, match=r"context parallel cannot be combined with recompute \(selective\): "
                                         r"recompute='selective' recomputes the serial attention core"):
        check(Options(cp=2, recompute="selective"), CFG, 2, batch_size=4, seq_len=8)
    with pytest.raises(ValueError, match=r"ep=2 needs an MoE model .* n_experts \(3\) and dp \(2\)"):
        check_3d(2, CFG, 4, 2, 1, 1, 1, ep=2, moe=dict(n_experts=3))
    with pytest.raises(ValueError, match=r"ep=3 is carved from dp=4 and must divide it"):
        run(lambda comm: Mesh(comm, dp=4, ep=3), ranks=4)
    with pytest.raises(ValueError, match=r"mesh size cp=0 must be a positive integer"):
        run(lambda comm: Mesh(comm, dp=1, cp=0), ranks=1)
