"""DDP == its serial twin (one process on the global batch), plus buckets, overlap, bytes, errors.

Tolerance 1e-10 on float64 models: the parallel run sums the same per-sample gradients in a
different order (per rank, weighted by n_r, then ring-reduced, then divided by N) than the
serial mean, so results agree to rounding (~1e-15 observed), not bit for bit.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from minidist.autograd import ops
from minidist.comm import measure, run
from minidist.nn import GPT, Linear, Module, optim
from minidist.nn.data import DistributedSampler
from minidist.nn.serial import max_state_diff
from minidist.parallel.data.compress import allreduce_hook
from minidist.parallel.data.ddp import DDP
from minidist.trace import hidden_fraction
from tests.conftest import budget
from tests.parallel.data.conftest import (
    CFG,
    TOL,
    accumulate,
    data,
    make_opt,
    my_rows,
    serial_gpt,
    uneven_counts,
)

ROOT = Path(__file__).resolve().parents[3]


def ddp_gpt(comm, batches, counts, accum, bucket_bytes, lr=1e-2, opt="adamw", **kw):
    m = GPT(CFG.replace(seed=comm.rank * 7))  # differently seeded: the broadcast must fix it
    ddp = DDP(m, comm, bucket_bytes=bucket_bytes)
    opt = make_opt(opt, m.parameters(), lr)
    for x, y in batches:
        sl = my_rows(counts, comm.rank)
        opt.zero_grad()
        accumulate(ddp, m.loss, x[sl], y[sl], accum, **kw)
        ddp.wait_gradients()
        opt.step()
    return {k: np.array(v) for k, v in m.state_dict().items()}


@budget(12)
@given(p=st.integers(1, 4), accum=st.integers(1, 3),
       extra=st.lists(st.integers(-3, 3), min_size=7, max_size=7),
       bucket_bytes=st.sampled_from([64, 700, 5000, 1 << 30]), opt=st.sampled_from(["adamw", "sgd"]))
@example(p=3, accum=1, extra=[-1, 0, 2, 0, 0, 0, 0], bucket_bytes=700, opt="sgd")  # rank 0 has no samples
@example(p=5, accum=2, extra=[0, -2, 1, 3, -1, 0, 0], bucket_bytes=64, opt="sgd")
@example(p=6, accum=1, extra=[0, 1, 0, 2, 0, 1, 0], bucket_bytes=5000, opt="adamw")
@example(p=7, accum=1, extra=[0, 0, 1, 0, 2, 0, -1], bucket_bytes=1 << 30, opt="sgd")
def test_ddp_equals_serial_uneven_batches(p, accum, extra, bucket_bytes, opt):
    counts = uneven_counts(p, accum, extra)  # ranks uneven, some micro-steps (or ranks) empty
    batches = data(counts, steps=2, accum=accum)
    want = serial_gpt(batches, opt=opt)
    got = run(ddp_gpt, ranks=p, batches=batches, counts=counts, accum=accum, bucket_bytes=bucket_bytes,
              opt=opt)
    for r in range(p):
        assert max_state_diff(got[r], want) < TOL
        assert max_state_diff(got[r], got[0]) == 0.0  # replicas identical, bit for bit


@budget(10)
@given(p=st.integers(1, 4), accum=st.integers(1, 3),
       extra=st.lists(st.integers(0, 3), min_size=4, max_size=4), sync_last=st.booleans(),
       ignore=st.sampled_from([0.0, 0.4]))
def test_ddp_equals_serial_with_every_micro_step_in_no_sync_or_ignored_tokens(p, accum, extra, sync_last,
                                                                              ignore):
    """Regression: with every micro-step inside ``no_sync()`` no backward queued the all-reduce of the
    sample counts, and ``wait_gradients`` divided by p x micro-steps (error 0.13 for counts [1, 3]).
    And with ignored targets the loss is a mean over valid tokens: weighting by them is exact."""
    counts = [accum + e for e in extra[:p]]
    batches = data(counts, steps=2, accum=accum, seed=5, ignore=ignore)
    want = serial_gpt(batches)
    got = run(ddp_gpt, ranks=p, batches=batches, counts=counts, accum=accum, bucket_bytes=700,
              sync_last=sync_last, tokens=ignore > 0)
    for r in range(p):
        assert max_state_diff(got[r], want) < TOL


def test_all_no_sync_window_gradient_equals_serial_gradient():
    """The reported case, on the gradient itself: counts [1, 3], one micro-step each in no_sync()."""
    counts = [1, 3]
    (x, y), = data(counts, steps=1, accum=1, seed=1)
    m = GPT(CFG)
    m.loss(x, y).backward()
    want = {n: p.grad for n, p in m.named_parameters()}

    def body(comm):
        m = GPT(CFG)
        ddp = DDP(m, comm, bucket_bytes=700)
        sl = my_rows(counts, comm.rank)
        with ddp.no_sync():
            ddp.backward(m.loss(x[sl], y[sl]), n_samples=counts[comm.rank])
        ddp.wait_gradients()
        return {n: np.array(p.grad) for n, p in m.named_parameters()}

    for got in run(body, ranks=2):
        assert max_state_diff(got, want) < TOL


def test_buckets_start_during_backward_and_bytes_match_ring_formula():
    p = 3

    def body(comm):
        m = GPT(CFG)
        ddp = DDP(m, comm, bucket_bytes=2000)
        x = np.arange(10).reshape(2, 5) % CFG.vocab_size
        with measure(comm) as m_:
            ddp.backward(m.loss(x, x))
            ddp.wait_gradients()
        ring = [c for c in m_.calls if c.name == "ring_all_reduce"]
        want = 0
        for b in ddp.buckets:  # rank r sends every chunk but its own, then every chunk but r+1's
            chunks = [len(c) for c in np.array_split(np.arange(b.numel), p)]
            want += (2 * b.numel - chunks[comm.rank] - chunks[(comm.rank + 1) % p]) * 8
        return (len(ddp.buckets), ddp.started_in_backward, len(ring), sum(c.bytes_sent for c in ring), want,
                [b.numel for b in ddp.buckets])

    for nb, started, nring, sent, want, sizes in run(body, ranks=p):
        assert nb >= 3 and started == nb and nring == nb  # every bucket launched from a hook
        assert sent == want
        psi = sum(sizes)
        assert abs(sent - 2 * (p - 1) / p * psi * 8) <= 2 * 8 * nb  # 2(p-1)/p Ψ, up to chunk rounding


def test_first_bucket_all_reduce_runs_while_backward_is_still_computing():
    """Overlap, deterministically: a hook on the first block's first parameter (the embedding's
    gradients are still to come) blocks backward until bucket 0's all-reduce (head and last layer) has
    *finished*. That can only happen if the bucket was started from a hook and ran on the async worker
    during backward; had DDP deferred communication to ``wait_gradients`` the wait would time out.
    Then ``ddp.events`` must show bucket 0's collective inside the backward span, and
    ``hidden_fraction`` > 0."""
    def body(comm):
        m = GPT(CFG)
        ddp = DDP(m, comm, bucket_bytes=2000)
        seen = {}

        def wait_for_bucket0(p):
            seen["started"] = sorted(ddp.window.handles)  # buckets started so far in this backward
            ddp.window.handles[0].wait()

        m[1].ln1.weight.register_post_accumulate_grad_hook(wait_for_bucket0)
        x = np.arange(10).reshape(2, 5) % CFG.vocab_size
        ddp.backward(m.loss(x, x))
        ddp.wait_gradients()
        (b0, b1), = [(a, b) for _, kind, a, b in ddp.events if kind == "backward"]
        c0, c1 = next((a, b) for name, kind, a, b in ddp.events if name == "all-reduce b0")
        return len(ddp.buckets), seen["started"], (b0, c0, c1, b1), hidden_fraction(ddp.events)

    for nb, started, (b0, c0, c1, b1), hidden in run(body, ranks=3):
        assert nb >= 3 and 0 in started and nb - 1 not in started  # the embedding's bucket: still to come
        assert b0 < c0 <= c1 < b1  # bucket 0's all-reduce ran from start to end inside backward
        assert hidden > 0.0


def test_a_comm_hook_sees_each_bucket_once_in_backward_order_and_only_the_last_as_last():
    """A hook counts steps on ``is_last`` (PowerSGD's start_iter does): exactly one bucket per step
    may say it, the one DDP starts last -- the bucket that holds the model's first parameter, whose
    gradient backward produces last. Marking any other (the first, say) would count a step early."""
    def body(comm):
        m = GPT(CFG)
        ddp = DDP(m, comm, bucket_bytes=2000)
        seen = []

        def hook(state, bucket):
            seen.append((bucket.index, bucket.is_last, [tuple(s) for s in bucket.shapes]))
            return allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, hook)
        x = np.arange(10).reshape(2, 5) % CFG.vocab_size
        for _ in range(2):
            ddp.backward(m.loss(x, x))
            ddp.wait_gradients()
        return seen, len(ddp.buckets), tuple(m.parameters()[0].shape)

    for seen, nb, first_shape in run(body, ranks=2):
        assert nb >= 3
        steps = [seen[:nb], seen[nb:]]
        assert len(seen) == 2 * nb
        for step in steps:
            assert [i for i, _, _ in step] == list(range(nb))  # every bucket once, in order
            assert [last for _, last, _ in step] == [False] * (nb - 1) + [True]
            assert step[-1][2][-1] == first_shape  # the last bucket ends with the first parameter


def test_no_sync_sends_nothing():
    def body(comm):
        m = GPT(CFG)
        ddp = DDP(m, comm)
        x = np.zeros((2, 5), np.int64)
        with measure(comm) as meas, ddp.no_sync():
            ddp.backward(m.loss(x, x))
        return meas.bytes_sent, m.parameters()[0].grad is not None

    assert run(body, ranks=2) == [(0, True), (0, True)]


def test_plain_backward_averages_over_ranks_like_pytorch():
    """Without ``ddp.backward``: hooks still sync, and the gradient is the mean over ranks (equal batches)."""
    batches = data([2, 2, 2], steps=2, accum=1)
    want = serial_gpt(batches)

    def body(comm):
        m = GPT(CFG)
        ddp = DDP(m, comm, bucket_bytes=3000)
        opt = optim.AdamW(m.parameters(), lr=1e-2)
        for x, y in batches:
            sl = my_rows([2, 2, 2], comm.rank)
            opt.zero_grad()
            m.loss(x[sl], y[sl]).backward()
            ddp.wait_gradients()
            opt.step()
        return {k: np.array(v) for k, v in m.state_dict().items()}

    for got in run(body, ranks=3):
        assert max_state_diff(got, want) < TOL


def test_second_syncing_backward_without_wait_is_an_error():
    def body(comm):
        m = GPT(CFG)
        ddp = DDP(m, comm)
        x = np.zeros((2, 5), np.int64)
        ddp.backward(m.loss(x, x))
        with pytest.raises(RuntimeError, match="without wait_gradients"):
            ddp.backward(m.loss(x, x))
        ddp.wait_gradients()
        ddp.wait_gradients()  # nothing new: a no-op, no communication
        return True

    assert run(body, ranks=2) == [True, True]


class Odd(Module):
    """Tied weights (``shared`` used twice), a frozen layer, and a branch only some samples use."""

    def __init__(self, seed):
        super().__init__()
        rng = np.random.default_rng(seed)
        kw = dict(dtype=np.float64, rng=rng)
        self.inp = Linear(3, 4, **kw)
        self.shared = Linear(4, 4, **kw)
        self.branch = Linear(4, 4, **kw)
        self.frozen = Linear(4, 2, **kw)
        for p in self.frozen.parameters():
            p.requires_grad = False

    def loss(self, x, flag):
        """Mean over rows of |out|², where flagged rows also pass through ``branch``."""
        h = self.shared(ops.tanh(self.shared(ops.tanh(self.inp(x)))))
        total = 0.0
        for rows, use in ((np.flatnonzero(~flag), False), (np.flatnonzero(flag), True)):
            if len(rows):
                hr = h[rows]
                out = self.frozen(self.branch(hr) if use else hr)
                total = (out * out).sum() + total
        return total / len(x)


@pytest.mark.parametrize("flags", ["none", "rank1", "all"])
def test_unused_tied_and_frozen_parameters(flags):
    rng = np.random.default_rng(3)
    counts, steps = [3, 2, 4], 2
    xs = [rng.standard_normal((sum(counts), 3)) for _ in range(steps)]
    flag = np.zeros(sum(counts), bool)
    if flags == "rank1":
        flag[3:5] = True
    elif flags == "all":
        flag[::2] = True

    def train(model, ddp, rows):
        opt = optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
        for x in xs:
            opt.zero_grad()
            if ddp is None:
                model.loss(x, flag).backward()
            else:
                ddp.backward(model.loss(x[rows], flag[rows]), n_samples=len(x[rows]))
                ddp.wait_gradients()
            opt.step()
        return {k: np.array(v) for k, v in model.state_dict().items()}

    want = train(Odd(0), None, None)

    def body(comm):
        m = Odd(comm.rank)
        ddp = DDP(m, comm, bucket_bytes=100, find_unused_parameters=True)
        return train(m, ddp, my_rows(counts, comm.rank))

    for got in run(body, ranks=3):
        assert max_state_diff(got, want) < TOL
    if flags == "none":  # never used anywhere: untouched, as in the serial run
        assert np.array_equal(want["branch.weight"], Odd(0).branch.weight.data)


def test_ranks_disagreeing_on_the_model_is_an_error_not_a_hang():
    def body(comm):
        DDP(GPT(CFG.replace(d_model=8 if comm.rank != 1 else 12, n_head=2)), comm)

    with pytest.raises(ValueError, match=r"disagree on the model.*ranks \[1\]"):
        run(body, ranks=3)


@budget(15)
@given(n=st.integers(0, 40), size=st.integers(1, 5), seed=st.integers(0, 3), drop_last=st.booleans(),
       even=st.booleans())
def test_distributed_sampler_shards(n, size, seed, drop_last, even):
    shards = [DistributedSampler(n, r, size, seed=seed, drop_last=drop_last, even=even) for r in range(size)]
    idx = [s.indices() for s in shards]
    flat = np.concatenate(idx)
    if even:
        assert len({len(i) for i in idx}) == 1  # equal shards
    else:
        assert max(map(len, idx)) - min(map(len, idx)) <= 1
        assert sorted(flat.tolist()) == list(range(n))  # exact cover, no duplicates
    if even and drop_last:
        assert len(set(flat.tolist())) == len(flat) == n - n % size
    if even and not drop_last and n:
        assert set(flat.tolist()) == set(range(n))
    for s in shards:
        s.set_epoch(1)
    if n > 3:
        assert not np.array_equal(np.concatenate([s.indices() for s in shards]), flat)


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
def test_ddp_and_zero_under_mpirun():
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("MINIDIST_TRANSPORT", None)
    res = subprocess.run(["mpirun", "-n", "2", sys.executable, __file__],
                         capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("OK rank") == 2, res.stdout


def _mpi_main():
    """Under ``mpirun -n 2 python tests/parallel/data/test_ddp.py``: DDP and ZeRO-3 == serial."""
    from minidist.parallel.data.zero import ZeRO

    counts, accum = [3, 2], 2
    batches = data(counts, steps=2, accum=accum)
    want = serial_gpt(batches)

    def body(comm):
        assert comm.transport == "mpi" and comm.size == 2
        got = ddp_gpt(comm, batches, counts, accum, bucket_bytes=1500)
        assert max_state_diff(got, want) < TOL, max_state_diff(got, want)
        m = GPT(CFG.replace(seed=comm.rank))
        z = ZeRO(m, comm, lambda ps: optim.AdamW(ps, lr=1e-2), stage=3)
        for x, y in batches:
            sl = my_rows(counts, comm.rank)
            accumulate(z, m.loss, x[sl], y[sl], accum)
            z.step()
        got = {k: np.array(v) for k, v in z.full_parameters().items()}
        assert max_state_diff(got, want) < TOL, max_state_diff(got, want)
        print(f"OK rank {comm.rank}", flush=True)

    run(body)


@pytest.mark.parametrize("backend", ["numpy", "jax"])
def test_bucket_views_average_in_one_call(backend):
    """A bucket's summed gradient -> each parameter's average: flat / divisor, cut and reshaped. On
    JAX that is one compiled program for the whole bucket (a divide program more, eagerly), reused
    for every divisor, with NumPy's bits."""
    if backend == "jax":
        pytest.importorskip("jax")
    from minidist.accel import jax_engine
    from minidist.accel.backend import get_backend
    from minidist.nn.module import Parameter
    from minidist.parallel.data.ddp import Bucket

    be = get_backend(backend)
    params = [Parameter(be.from_host(np.zeros(s, np.float32))) for s in [(2, 3), (4,), (1, 5)]]
    b = Bucket(0, params)
    flat = np.arange(15, dtype=np.float32) * 3
    before = jax_engine.compilations() if backend == "jax" else 0
    for _ in range(3):
        got = [np.asarray(be.to_host(v)) for v in b.views(be.from_host(flat), 4.0)]
    want = [flat[:6].reshape(2, 3) / 4, flat[6:10] / 4, flat[10:].reshape(1, 5) / 4]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
        assert g.dtype == np.float32
    if backend == "jax" and jax_engine.enabled():
        assert jax_engine.compilations() - before == 1
    before = jax_engine.compilations() if backend == "jax" else 0
    for divisor in (3.0, 7.0, 0.3):  # weighted DDP, a short last batch: other divisors, the same program
        got = [np.asarray(be.to_host(v)) for v in b.views(be.from_host(flat), divisor)]
        want = [flat[:6].reshape(2, 3) / divisor, flat[6:10] / divisor, flat[10:].reshape(1, 5) / divisor]
        for g, w in zip(got, want):
            assert g.dtype == np.float32
            if backend == "numpy":
                assert g.tobytes() == w.tobytes()
            else:  # XLA's CPU divide is x * (1/d), the divisor baked in or not: within an ulp
                np.testing.assert_array_max_ulp(g, w, maxulp=1)
    if backend == "jax" and jax_engine.enabled():
        assert jax_engine.compilations() - before == 0  # the divisor is an argument, not a constant


if __name__ == "__main__":
    _mpi_main()
