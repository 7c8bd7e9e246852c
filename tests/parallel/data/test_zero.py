"""ZeRO stages 1-3 == the serial twin (AdamW on the global batch); bytes and memory per the formulas.

Tolerance 1e-10 on float64 models (summation order differs from the serial mean; see
test_data_parallel.py). Ledger bytes and memory bytes are exact (array_split shard sizes).
"""

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from minidist.autograd.tensor import saved_tensors_hooks
from minidist.comm import measure, run
from minidist.nn import GPT, optim
from minidist.nn.footprint import MemoryAccountant, zero_formula
from minidist.nn.serial import max_state_diff
from minidist.parallel.data.zero import ZeRO, param_count
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


def adamw(ps):
    return optim.AdamW(ps, lr=1e-2)


def zero_gpt(comm, batches, counts, accum, stage, bucket_bytes, sync_last=True, opt="adamw"):
    m = GPT(CFG.replace(seed=comm.rank * 3))
    z = ZeRO(m, comm, lambda ps: make_opt(opt, ps), stage=stage, bucket_bytes=bucket_bytes)
    for x, y in batches:
        sl = my_rows(counts, comm.rank)
        accumulate(z, m.loss, x[sl], y[sl], accum, sync_last=sync_last)
        z.step()
    return {k: np.array(v) for k, v in z.full_parameters().items()}


@budget(15)
@given(stage=st.integers(1, 3), p=st.integers(1, 4), accum=st.integers(1, 2),
       extra=st.lists(st.integers(-2, 2), min_size=7, max_size=7),
       bucket_bytes=st.sampled_from([64, 3000, 1 << 30]), sync_last=st.booleans(),
       opt=st.sampled_from(["adamw", "sgd"]))
@example(stage=3, p=3, accum=1, extra=[0, 1, 2, 0, 0, 0, 0], bucket_bytes=3000, sync_last=True, opt="sgd")
@example(stage=3, p=3, accum=2, extra=[-2, 0, 1, 0, 0, 0, 0], bucket_bytes=64, sync_last=True, opt="adamw")
@example(stage=2, p=3, accum=1, extra=[1, -1, 0, 0, 0, 0, 0], bucket_bytes=64, sync_last=True, opt="sgd")
@example(stage=2, p=5, accum=1, extra=[0, 1, 0, 2, -1, 0, 0], bucket_bytes=3000, sync_last=False, opt="sgd")
@example(stage=1, p=6, accum=2, extra=[0, 0, 1, 0, 0, 2, 0], bucket_bytes=64, sync_last=True, opt="sgd")
@example(stage=3, p=7, accum=1, extra=[0, 0, 1, 0, 0, 1, 0], bucket_bytes=1 << 30, sync_last=True, opt="sgd")
def test_zero_equals_serial(stage, p, accum, extra, bucket_bytes, sync_last, opt):
    """``sync_last=False``: every micro-step in no_sync(), ``step`` communicates everything. Plain SGD
    too: a gradient that is p times too large (a sum, not a mean) changes its parameters p-fold.
    A rank may have no samples (it still joins every collective, weighted by 0)."""
    counts = uneven_counts(p, accum, extra)
    batches = data(counts, steps=2, accum=accum, seed=stage)
    want = serial_gpt(batches, opt=opt)
    for got in run(zero_gpt, ranks=p, batches=batches, counts=counts, accum=accum, stage=stage,
                   bucket_bytes=bucket_bytes, sync_last=sync_last, opt=opt):
        assert max_state_diff(got, want) < TOL


def _memory_during_step(comm, stage, n_layer, bucket_bytes):
    """One ZeRO step of a GPT, sampling the memory accountant's report during forward (at every
    array an op saves) and during backward (after every parameter's gradient is accumulated)."""
    m = GPT(CFG.replace(n_layer=n_layer))
    z = ZeRO(m, comm, lambda ps: optim.SGD(ps, lr=0.1), stage=stage, bucket_bytes=bucket_bytes)
    acct, seen, phase = MemoryAccountant(), {"forward": [], "backward": []}, ["forward"]

    def sample(*_):
        seen[phase[0]].append(acct.report(m, z))
    for p in m.parameters():  # after ZeRO's own hooks: sees what they left
        p.register_post_accumulate_grad_hook(sample)
    x = np.arange(12).reshape(2, 6) % CFG.vocab_size
    with saved_tensors_hooks(lambda a: (sample(), a)[1], lambda a: a):
        loss = m.loss(x, x)
    phase[0] = "backward"
    z.backward(loss)
    started = z.started_in_backward
    z.step()
    shard = sum(hi - lo for lo, hi in (b.shard(comm.rank, comm.size) for b in z.buckets)) * 8
    return dict(started=started, buckets=len(z.buckets), shard=shard, psi=param_count(m) * 8,
                bucket=max(b.numel for b in z.buckets) * 8,
                unit=max(sum(p.size for p in u.parameters()) for u in z.units) * 8,
                **{f"{k}_{ph}": max(r[k] for r in seen[ph]) for k in ("params", "grads") for ph in seen})


def test_zero2_reduce_scatters_start_in_backward_and_gradients_stay_sharded():
    """ZeRO-2's point: every bucket's reduce-scatter starts from the backward hook, the full gradient
    is dropped as it goes, so backward never holds more than a shard plus the bucket being filled.
    (Deferring the reduce-scatters to step() gives the same parameters and bytes: only this sees it.)"""
    for r in run(_memory_during_step, ranks=4, stage=2, n_layer=2, bucket_bytes=1000):
        assert r["buckets"] > 3 and r["started"] == r["buckets"]
        assert r["grads_backward"] <= r["shard"] + r["bucket"] < r["psi"] / 2
        assert r["params_backward"] == r["psi"]  # parameters are not sharded at stage 2


def test_zero3_holds_one_unit_beyond_its_shard_in_forward_and_backward():
    """ZeRO-3: a unit's parameters are gathered just before use and freed right after, so at any
    moment a rank holds its shard of every parameter plus (at most) the one unit being computed."""
    for r in run(_memory_during_step, ranks=4, stage=3, n_layer=4, bucket_bytes=1000):
        assert r["started"] == r["buckets"]  # one bucket per unit, each started in backward
        for phase in ("forward", "backward"):
            assert r["shard"] < r[f"params_{phase}"] <= r["shard"] + r["unit"] < r["psi"] / 2, phase
        assert r["grads_backward"] <= r["shard"] + r["unit"]


def _chunks(n, p):
    return [len(c) for c in np.array_split(np.arange(n), p)]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_ledger_bytes_match_formulas(stage):
    """Per rank: reduce-scatter sends N - |c_r|, ring all-gather N - |c_{r+1}| (per bucket, x8 bytes).
    Stages 1/2: one of each = 2(p-1)/p Ψ. Stage 3 (units Embed, Block x n_layer, Head): every unit is
    gathered in forward, and again in backward exactly when backward needs its weights: every Block
    (linear and LayerNorm saved their weights) and the Head (its forward released it before the loss;
    its backward is the first to run), but not the Embed (the gradient of a lookup needs only the token
    ids, of the position table only the output gradient). So 3Ψ less one all-gather of the embeddings."""
    p, cfg = 3, CFG.replace(n_layer=2)

    def body(comm):
        m = GPT(cfg)
        z = ZeRO(m, comm, adamw, stage=stage, bucket_bytes=3000)
        x = np.arange(12).reshape(2, 6) % CFG.vocab_size
        z.gather_log.clear()
        with measure(comm) as meas:
            z.backward(m.loss(x, x))
            z.step()
        sent = {}
        for c in meas.calls:
            sent[c.name] = sent.get(c.name, 0) + c.bytes_sent
        r = comm.rank
        rs = sum((b.numel - _chunks(b.numel, p)[r]) * 8 for b in z.buckets)
        ag_once = sum((b.numel - _chunks(b.numel, p)[(r + 1) % p]) * 8 for b in z.buckets)
        embed = sum(b.numel for b in z.buckets if stage == 3 and z.unit_of[b.index] == 0)
        ag_embed = (embed - _chunks(embed, p)[(r + 1) % p]) * 8  # the Embed unit is one bucket
        return sent, rs, ag_once, ag_embed, z.gather_log, param_count(m), embed

    head = cfg.n_layer + 1  # units: 0 Embed, 1..n_layer Blocks, n_layer + 1 Head
    for sent, rs, ag_once, ag_embed, log, psi, embed in run(body, ranks=p):
        assert sent["reduce_scatter"] == rs
        assert abs(rs - (p - 1) / p * psi * 8) <= 8 * 20
        if stage < 3:
            assert sent["all_gather"] == ag_once and log == []
            assert abs(rs + ag_once - 2 * (p - 1) / p * psi * 8) <= 8 * 40  # 2Ψ: as plain DP
        else:
            assert log == ([(u, "forward") for u in range(head + 1)]
                           + [(u, "backward") for u in range(head, 0, -1)])  # Head, Blocks; no Embed
            assert embed == (cfg.vocab_size + cfg.block_size) * cfg.d_model
            assert sent["all_gather"] == 2 * ag_once - ag_embed  # forward: all; backward: all but Embed
            assert abs(rs + sent["all_gather"] - (p - 1) / p * (3 * psi - embed) * 8) <= 8 * 40


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_memory_report_matches_formula(stage):
    p = 4

    def body(comm):
        from minidist.parallel.data.ddp import DDP

        m = GPT(CFG)
        acct = MemoryAccountant()
        x = np.arange(12).reshape(2, 6) % CFG.vocab_size
        if stage == 0:
            ddp, opt = DDP(m, comm), adamw(m.parameters())
            for _ in range(2):
                opt.zero_grad()
                ddp.backward(m.loss(x, x))
                ddp.wait_gradients()
                rep = acct.report(m, opt)
                opt.step()
            return rep, [], param_count(m)
        z = ZeRO(m, comm, adamw, stage=stage, bucket_bytes=1 << 30)
        for _ in range(2):
            with acct.track_activations(m):
                loss = m.loss(x, x)
            z.backward(loss)
            z.wait_gradients()
            rep = acct.report(m, z)
            z.update()
        return rep, [b.shard(comm.rank, p) for b in z.buckets], param_count(m)

    for rep, shards, psi in run(body, ranks=p):
        mine = sum(hi - lo for lo, hi in shards)
        full, part = psi * 8, mine * 8
        want = {0: (full, full, 2 * full), 1: (full, full, 2 * part), 2: (full, part, 2 * part),
                3: (part, part, 2 * part)}[stage]
        assert (rep["params"], rep["grads"], rep["optimizer_state"]) == want
        f = zero_formula(stage, psi, p, 8, 8, 16)
        assert abs(rep["total"] - f["total"]) <= 32 * 8  # the formula, up to shard rounding
        if stage:
            assert rep["activations_peak"] > 0


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sharded_checkpoint_restart_equals_uninterrupted_run(stage):
    """Train 2 steps, save every rank's shard, start a fresh run (other seeds), load, train 2 more:
    bit-identical to 4 uninterrupted steps. A shard loaded on the wrong rank is refused."""
    batches = data([2, 3], 4, 1, seed=5)

    def train(z, m, steps):
        for x, y in steps:
            sl = my_rows([2, 3], z.comm.rank)
            accumulate(z, m.loss, x[sl], y[sl], 1)
            z.step()

    def body(comm):
        m = GPT(CFG.replace(seed=comm.rank))
        z = ZeRO(m, comm, adamw, stage=stage, bucket_bytes=3000)
        train(z, m, batches)
        straight = {k: np.array(v) for k, v in z.full_parameters().items()}

        m1 = GPT(CFG.replace(seed=comm.rank))
        z1 = ZeRO(m1, comm, adamw, stage=stage, bucket_bytes=3000)
        train(z1, m1, batches[:2])
        saved = z1.state_dict()
        m2 = GPT(CFG.replace(seed=comm.rank + 7))
        z2 = ZeRO(m2, comm, adamw, stage=stage, bucket_bytes=3000).load_state_dict(saved)
        train(z2, m2, batches[2:])
        resumed = {k: np.array(v) for k, v in z2.full_parameters().items()}
        wrong = dict(saved, rank=1 - comm.rank)
        with pytest.raises(ValueError, match="load each rank's own shard"):
            z2.load_state_dict(wrong)
        return straight, resumed

    for straight, resumed in run(body, ranks=2):
        assert straight.keys() == resumed.keys()
        for k in straight:
            np.testing.assert_array_equal(straight[k], resumed[k], err_msg=k)


def test_bad_stage_and_shared_units_are_errors():
    def bad_stage(comm):
        ZeRO(GPT(CFG), comm, adamw, stage=4)

    with pytest.raises(ValueError, match="stage must be 1, 2 or 3"):
        run(bad_stage, ranks=2)

    cfg = CFG.replace(vocab_size=8)  # wte (8, 8) and the head's proj (8, 8): tieable

    def tied_ok_shape(comm):
        m = GPT(cfg)
        m[-1].proj.weight = m[0].wte.weight
        ZeRO(m, comm, adamw, stage=3)

    with pytest.raises(ValueError, match="shares a parameter"):
        run(tied_ok_shape, ranks=2)


def test_activation_accountant_counts_and_releases():
    m = GPT(CFG)
    acct = MemoryAccountant()
    x = np.zeros((3, 6), np.int64)
    with acct.track_activations(m):
        loss = m.loss(x, x)
    assert acct.activation_bytes == acct.peak_activation_bytes > 0
    loss.backward()
    assert acct.activation_bytes == 0  # backward released everything it saved


def test_clip_grad_norm_is_global():
    """ZeRO's clipping sees the norm of the whole gradient, not of this rank's slice."""
    batches = data([2, 3], steps=2, accum=1)
    m = GPT(CFG)
    opt = optim.AdamW(m.parameters(), lr=1e-2)
    norms = []
    for x, y in batches:
        opt.zero_grad()
        m.loss(x, y).backward()
        norms.append(optim.clip_grad_norm(m.parameters(), 0.5))
        opt.step()
    want = {k: np.array(v) for k, v in m.state_dict().items()}

    def body(comm):
        m = GPT(CFG)
        z = ZeRO(m, comm, adamw, stage=2, bucket_bytes=3000)
        got_norms = []
        for x, y in batches:
            sl = my_rows([2, 3], comm.rank)
            z.backward(m.loss(x[sl], y[sl]), n_samples=len(x[sl]))
            z.wait_gradients()
            got_norms.append(z.clip_grad_norm(0.5))
            z.update()
        return got_norms, {k: np.array(v) for k, v in z.full_parameters().items()}

    for got_norms, got in run(body, ranks=2):
        assert np.allclose(got_norms, norms, rtol=1e-10)
        assert max_state_diff(got, want) < TOL


def test_ddp_and_zero3_on_jax():
    """The same code on JAX arrays (immutable: every update builds new arrays). A two-layer net keeps
    JAX's per-op compilation cheap (and SGD, for the same reason). float32: tolerance 1e-5."""
    pytest.importorskip("jax")
    from minidist.accel.backend import get_backend
    from minidist.nn import Linear, Sequential
    from minidist.parallel.data.ddp import DDP

    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)

    def net():
        rng = np.random.default_rng(1)
        return Sequential([Linear(3, 4, rng=rng, backend="jax"), Linear(4, 2, rng=rng, backend="jax")])

    def loss(m, rows):
        out = m(get_backend("jax").from_host(x[rows]))
        return (out * out).mean()

    def serial(comm):
        m = net()
        o = optim.SGD(m.parameters(), lr=0.1)
        loss(m, slice(0, 4)).backward()
        o.step()
        return {k: np.asarray(v) for k, v in m.state_dict().items()}

    def body(comm):
        sl = slice(2 * comm.rank, 2 * comm.rank + 2)
        m = net()
        d, o = DDP(m, comm), optim.SGD(m.parameters(), lr=0.1)
        d.backward(loss(m, sl), n_samples=2)
        d.wait_gradients()
        o.step()
        m3 = net()
        z = ZeRO(m3, comm, lambda ps: optim.SGD(ps, lr=0.1), stage=3)
        z.backward(loss(m3, sl), n_samples=2)
        z.step()
        return ({k: np.asarray(v) for k, v in m.state_dict().items()},
                {k: np.asarray(v) for k, v in z.full_parameters().items()})

    want = run(serial, ranks=1, backend="jax")[0]
    for ddp_params, zero_params in run(body, ranks=2, backend="jax"):
        assert max_state_diff(ddp_params, want) < 1e-5 and max_state_diff(zero_params, want) < 1e-5
