"""Local SGD / DiLoCo (minidist/parallel/data/local_sgd.py): H = 1, outer lr 1, no momentum is DDP; the
anchors are identical on every rank; it sends one all-reduce of the model per H steps; streaming
fragments sync at staggered steps."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist.comm import measure, run
from minidist.nn import GPT, GPTConfig, optim
from minidist.parallel.data.compress import make_hook
from minidist.parallel.data.ddp import DDP
from minidist.parallel.data.local_sgd import LocalSGD, streaming_diloco
from tests.conftest import budget

CFG = GPTConfig(vocab_size=11, block_size=6, n_layer=1, n_head=2, d_model=8, dtype="float64")


def batches(p, steps, seed=0, rows=2):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 11, (rows * p, 5)), rng.integers(0, 11, (rows * p, 5))) for _ in range(steps)]


def mine(comm, x, rows=2):
    return x[rows * comm.rank:rows * (comm.rank + 1)]


def state(model):
    return {n: np.array(q.data) for n, q in model.named_parameters()}


@given(p=st.integers(1, 3), steps=st.integers(1, 3), lr=st.floats(0.01, 0.5), mom=st.sampled_from([0.0, 0.9]),
       seed=st.integers(0, 20))
@budget(5)
def test_h1_outer_lr1_no_momentum_is_ddp(p, steps, lr, mom, seed):
    """Inner SGD (with or without heavy-ball momentum: both linear in the gradient) on each rank, then
    the mean of the ranks' parameters == DDP's step on the mean gradient (to rounding: Δ = anchor - θ
    is taken and added back, 1e-12)."""
    data = batches(p, steps, seed)

    def body(comm):
        a, b = GPT(CFG.replace(seed=seed)), GPT(CFG.replace(seed=seed))
        ddp = DDP(a, comm)
        opt_a = optim.SGD(a.parameters(), lr=lr, momentum=mom)
        local = LocalSGD(b, comm, optim.SGD(b.parameters(), lr=lr, momentum=mom), H=1, outer_lr=1.0,
                         momentum=0.0)
        for x, y in data:
            ddp.backward(a.loss(mine(comm, x), mine(comm, y)))
            ddp.wait_gradients()
            opt_a.step()
            opt_a.zero_grad()
            b.loss(mine(comm, x), mine(comm, y)).backward()
            local.step()
            local.zero_grad()
        return state(a), state(b)
    for want, got in run(body, ranks=p):
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-12, atol=1e-12, err_msg=name)


def diloco_run(p, steps, **kw):
    data = batches(p, steps, 1)

    def body(comm):
        model = GPT(CFG)
        inner = optim.AdamW(model.parameters(), lr=1e-2)
        make = kw.pop("make", LocalSGD) if "make" in kw else LocalSGD
        outer = make(model, comm, inner, **kw)
        sent = []
        for x, y in data:
            with measure(comm) as m:
                model.loss(mine(comm, x), mine(comm, y)).backward()
                outer.step()
                outer.zero_grad()
            sent.append(m.bytes_sent)
        outer.finish_pending()
        return outer.anchors(), sent, sum(q.size for q in model.parameters()), outer.started
    return run(body, ranks=p)


def test_diloco_anchors_identical_and_one_all_reduce_per_h_steps():
    p, H = 2, 3
    out = diloco_run(p, 7, H=H, outer_lr=0.7, momentum=0.9)
    n = out[0][2]
    ring = 8 * 2 * (p - 1) * n // p  # ring all-reduce of n float64 (p divides n here)
    assert n % p == 0
    for anchors, sent, _, started in out:
        for a, b in zip(anchors, out[0][0]):
            np.testing.assert_array_equal(a, b)
        assert sent == [0, 0, ring, 0, 0, ring, 0]
        assert started == [(3, 0), (6, 0)]


def test_streaming_fragments_sync_at_staggered_steps_and_stay_identical():
    p, H, F = 2, 4, 2
    out = diloco_run(p, 9, H=H, make=streaming_diloco, fragments=F, overlap=1)
    n = out[0][2]
    for anchors, sent, _, started in out:
        for a, b in zip(anchors, out[0][0]):
            np.testing.assert_array_equal(a, b)
        # fragment 1 at steps 2, 6 (offset H/F = 2), fragment 0 at 4, 8: half the model at a time
        assert started == [(2, 1), (4, 0), (6, 1), (8, 0)]
        assert sum(sent) == 2 * 8 * n  # each fragment twice, ring on 2 ranks: its own bytes once



def test_diloco_delta_through_a_compression_hook_keeps_anchors_identical():
    out = diloco_run(3, 4, H=2, comm_hook=make_hook("topk", ratio=0.1))
    for anchors, _, _, _ in out:
        for a, b in zip(anchors, out[0][0]):
            np.testing.assert_array_equal(a, b)


def test_bad_arguments_are_refused():
    def body(comm):
        model = GPT(CFG)
        with pytest.raises(ValueError, match="H >= 1"):
            LocalSGD(model, comm, optim.SGD(model.parameters()), H=0)
        with pytest.raises(ValueError, match="momentum"):
            LocalSGD(model, comm, optim.SGD(model.parameters()), momentum=1.5)
    run(body, ranks=1)


# -- the outer update against DiLoCo's equations, written out -----------------------------------------

class ConstantStep:
    """An inner optimizer whose step is θ -= lr·c_r(t): rank r's made-up gradient at its t-th step, so the
    test knows every inner trajectory without a model's backward."""

    def __init__(self, params, rank, lr=0.1):
        self.params, self.rank, self.lr, self.t = params, rank, lr, 0

    def grad(self, i, shape):
        return np.sin(np.arange(np.prod(shape)).reshape(shape) + 10 * self.rank + 3 * self.t + i)

    def step(self):
        for i, p in enumerate(self.params):
            p.data = p.data - self.lr * self.grad(i, p.shape)
        self.t += 1

    def zero_grad(self):
        pass


def initial_weights():
    """A Linear(3, 2)'s weight and bias, fixed here (not drawn): the ranks and the hand computation
    start from the same numbers."""
    return [np.linspace(-1, 1, 6).reshape(3, 2), np.array([0.25, -0.5])]


def outer_by_hand(p, steps, H, lr_out, mu, nesterov, fragments=1, overlap=0):
    """θ after ``steps`` inner steps on every rank, from the equations of lessons/12-compression.md:
    Δ̄ = mean_r(anchor - θ_r), v = μv + Δ̄, anchor -= lr·(Δ̄ + μv) (Nesterov) or lr·v (heavy ball),
    θ = anchor (+ the local progress made during an overlapped sync). Elementwise, in float64."""
    init = initial_weights()
    theta = [[w.copy() for w in init] for _ in range(p)]
    inner = [ConstantStep([None] * len(init), r) for r in range(p)]
    groups = np.array_split(np.arange(len(init)), fragments)
    anchor, vel = [w.copy() for w in init], [np.zeros_like(w) for w in init]
    pending = {}  # fragment -> (step due, averaged deltas, θ per rank at the send)
    for t in range(1, steps + 1):
        for r in range(p):
            for i in range(len(init)):
                theta[r][i] = theta[r][i] - inner[r].lr * inner[r].grad(i, init[i].shape)
            inner[r].t += 1
        for f, ix in enumerate(groups):
            if f in pending and pending[f][0] == t:
                _, dbar, sent = pending.pop(f)
                for i in ix:
                    vel[i] = mu * vel[i] + dbar[i]
                    anchor[i] = anchor[i] - lr_out * (dbar[i] + mu * vel[i] if nesterov else vel[i])
                    for r in range(p):
                        theta[r][i] = anchor[i] + (theta[r][i] - sent[r][i])
        for f, ix in enumerate(groups):
            if (t + f * H // fragments) % H == 0:
                dbar = {i: sum(anchor[i] - theta[r][i] for r in range(p)) / p for i in ix}
                sent = [{i: theta[r][i].copy() for i in ix} for r in range(p)]
                pending[f] = (t + overlap, dbar, sent)
                if overlap == 0:
                    _, dbar, sent = pending.pop(f)
                    for i in ix:
                        vel[i] = mu * vel[i] + dbar[i]
                        anchor[i] = anchor[i] - lr_out * (dbar[i] + mu * vel[i] if nesterov else vel[i])
                        for r in range(p):
                            theta[r][i] = anchor[i].copy()
    return theta


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("fragments,overlap", [(1, 0), (2, 0), (2, 1), (1, 2)])
def test_outer_steps_over_several_syncs_equal_the_written_out_update(nesterov, fragments, overlap):
    """Three syncs (H = 3, 9 inner steps, outer lr 0.7, μ = 0.9): every rank's parameters equal the
    hand-written DiLoCo update elementwise -- the momentum carried from sync to sync, Nesterov or heavy
    ball as asked, and (streaming) the inner steps taken while a sync is in flight kept."""
    from minidist.nn import Linear

    p, steps, H = 3, 9, 3

    def body(comm):
        model = Linear(3, 2, dtype=np.float64)
        for q, w in zip(model.parameters(), initial_weights()):
            q.data = w.copy()
        inner = ConstantStep(list(model.parameters()), comm.rank)
        outer = LocalSGD(model, comm, inner, H=H, outer_lr=0.7, momentum=0.9, nesterov=nesterov,
                         fragments=fragments, overlap=overlap)
        for _ in range(steps):
            outer.step()
        return [np.array(q.data) for q in model.parameters()]

    want = outer_by_hand(p, steps, H, 0.7, 0.9, nesterov, fragments, overlap)
    for r, got in enumerate(run(body, ranks=p)):
        for g, w in zip(got, want[r]):
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)
