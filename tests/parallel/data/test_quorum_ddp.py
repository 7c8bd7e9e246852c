"""The quorum-averaged gradient: the participants' sum in group order over their number, on every
participant and every healer alike -- bit for bit the serial ``((g0 + g1) + g2) / n``."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist.comm import run
from minidist.nn import GPT, GPTConfig
from minidist.nn.optim import make_optimizer
from minidist.parallel.data.live.local_sgd import QuorumLocalSGD
from minidist.parallel.data.live.quorum_ddp import (
    QuorumDataParallel,
    StaticQuorum,
    StaticView,
    quorum_average,
)


@given(n=st.integers(1, 4), healers=st.integers(0, 2), size=st.integers(1, 50), seed=st.integers(0, 99))
def test_quorum_average_is_the_ordered_sum_over_the_participants_on_everyone(n, healers, size, seed):
    xs = [np.random.default_rng([seed, r]).standard_normal(size) for r in range(n)]
    want = xs[0].copy()
    for x in xs[1:]:
        want = want + x          # in group order, as the serial twin adds them up
    want = want / n

    def fn(comm):
        part = comm.split(0 if comm.rank < n else None, comm.rank)
        view = StaticView(part, comm, n)
        x = xs[comm.rank] if comm.rank < n else np.full(size, np.nan)  # a healer's x is never used
        return quorum_average(view, x)
    for r, got in enumerate(run(fn, ranks=n + healers)):
        assert np.array_equal(got, want), f"rank {r} of {n} participants + {healers} healers"


def test_quorum_data_parallel_sets_every_gradient_to_the_average_of_the_views_participants():
    cfg = GPTConfig(vocab_size=12, block_size=8, n_layer=1, n_head=2, d_model=8, dtype="float64", seed=1)
    x = np.random.default_rng(0).integers(0, 12, (4, 8))

    def fn(comm):
        model = GPT(cfg)
        model.loss(x[2 * comm.rank:2 * comm.rank + 2], x[2 * comm.rank:2 * comm.rank + 2]).backward()
        own = [p.grad.copy() for p in model.parameters()]
        QuorumDataParallel(model, StaticQuorum(comm)).wait_gradients()
        return own, [p.grad.copy() for p in model.parameters()]
    (g0, avg0), (g1, avg1) = run(fn, ranks=2)
    for a, b, m0, m1 in zip(g0, g1, avg0, avg1):
        assert np.array_equal(m0, (a + b) / 2) and np.array_equal(m1, m0)


def test_local_sgd_over_a_quorum_checks_its_arguments():
    model = GPT(GPTConfig(vocab_size=12, block_size=8, n_layer=1, n_head=2, d_model=8, seed=1))
    inner = make_optimizer("sgd", model.parameters(), 0.1)
    with pytest.raises(ValueError, match="H >= 1, outer_lr > 0 and momentum in \\[0, 1\\); got H=0"):
        QuorumLocalSGD(model, StaticQuorum(None), inner, H=0)
    outer = QuorumLocalSGD(model, StaticQuorum(None), inner, H=4)
    assert [outer.heals_at(s) for s in range(8)] == [False, False, False, True] * 2
