"""Mixed precision: bf16 rounding, the loss scaler, the agreed inf/NaN skip, training vs fp32."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist.comm import measure, run
from minidist.nn.gpt import GPT, GPTConfig
from minidist.nn.optim import SGD, AdamW
from minidist.parallel.memory.precision import (
    MixedPrecision,
    low_dtype,
)

ROOT = Path(__file__).resolve().parents[3]
CFG = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, d_model=32)


def mixed_steps(mp, opt, steps, idx) -> list:
    """``steps`` mixed-precision steps on (idx, idx), each asserted taken (no inf/NaN skip); the losses."""
    losses = []
    for _ in range(steps):
        loss = mp.loss(idx, idx)
        mp.backward(loss)
        assert mp.step(opt)
        losses.append(loss.item())
    return losses


def _train(dtype, steps, idx, lr=1e-3):
    model = GPT(CFG)
    if dtype == "fp32":
        opt = AdamW(model.parameters(), lr=lr)
        losses = []
        for _ in range(steps):
            loss = model.loss(idx, idx)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, [p.data for p in model.parameters()]
    mp = MixedPrecision(model, dtype)
    opt = AdamW(mp.master_params, lr=lr)
    losses = mixed_steps(mp, opt, steps, idx)
    return losses, [p.data for p in mp.master_params]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_mixed_precision_training_stays_close_to_fp32(dtype):
    """Stated tolerance over k = 6 AdamW steps (lr 1e-3): loss within 1% relative; master weights within
    2·k·lr of fp32's (an Adam step moves a weight by at most ~lr, so a gradient whose sign the rounding
    flips costs at most 2·lr per step), and on average within lr/10."""
    idx = np.random.default_rng(0).integers(0, 32, (4, 16))
    ref_losses, ref_params = _train("fp32", 6, idx)
    losses, params = _train(dtype, 6, idx)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-2)
    diffs = np.concatenate([np.abs(a - b).ravel() for a, b in zip(params, ref_params)])
    assert diffs.max() < 2 * 6 * 1e-3 and diffs.mean() < 1e-4
    assert losses[-1] < losses[0]


def test_model_computes_in_low_precision():
    mp = MixedPrecision(GPT(CFG), "bf16")
    assert {p.dtype for p in mp.params} == {low_dtype("bf16")}
    assert {m.dtype for m in mp.master_params} == {np.dtype(np.float32)}
    assert mp.model(np.zeros((1, 4), dtype=np.int64)).dtype == low_dtype("bf16")
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        low_dtype("fp8")


def _inf_rank_fn(comm, inject_rank, agree):
    dp = comm.split(comm.rank // 2, comm.rank)  # a 2 x 2 mesh: {0,1},{2,3} and {0,2},{1,3}
    tp = comm.split(comm.rank % 2, comm.rank)
    mp = MixedPrecision(GPT(CFG), "fp16", groups=[dp, tp] if agree else [])
    opt = AdamW(mp.master_params, lr=1e-3)
    before = [m.data.copy() for m in mp.master_params]
    idx = np.random.default_rng(comm.rank).integers(0, 32, (2, 8))
    loss = mp.loss(idx, idx)
    mp.backward(loss)
    if comm.rank == inject_rank:
        g = mp.params[3].grad.copy()
        g.flat[0] = np.inf
        mp.params[3].grad = g
    stepped = mp.step(opt)
    unchanged = all(np.array_equal(a, m.data) for a, m in zip(before, mp.master_params))
    return stepped, mp.scale, unchanged, opt.step_count


def _inf_gathered(comm, **kw):
    results = comm.gather_obj(_inf_rank_fn(comm, **kw))
    if comm.rank == 0:
        print("\n".join(f"RESULT {r}" for r in results), flush=True)


@given(inject_rank=st.integers(0, 3))
def test_injected_inf_on_one_rank_makes_every_rank_skip_and_halve(inject_rank):
    results = run(_inf_rank_fn, ranks=4, inject_rank=inject_rank, agree=True)
    assert results == [(False, 2.0 ** 15, True, 0)] * 4


def test_without_agreement_only_the_bad_rank_skips():
    results = run(_inf_rank_fn, ranks=4, inject_rank=1, agree=False)
    assert [r[0] for r in results] == [True, False, True, True]  # the divergence the flag prevents


def _ddp_inf(comm, inject_rank, groups):
    """DDP over 2 ranks wraps the fp16 model (MixedPrecision first); an inf is put into one rank's
    gradient after DDP's average, so only that rank sees it; then the step."""
    from minidist.parallel.data.ddp import DistributedDataParallel

    mp = MixedPrecision(GPT(CFG), "fp16", **({} if groups == "default" else {"groups": []}))
    ddp = DistributedDataParallel(mp.model, comm, broadcast_from=None)
    idx = np.random.default_rng(comm.rank).integers(0, 32, (2, 8))
    mp.backward(mp.loss(idx, idx))
    ddp.wait_gradients()
    if comm.rank == inject_rank:
        g = mp.params[0].grad.copy()
        g.flat[0] = np.inf
        mp.params[0].grad = g
    return [c is comm for c in mp.agreement_groups()], mp.step(SGD(mp.master_params, lr=0.1))


def test_a_ddp_wrapping_the_model_is_agreed_over_by_default():
    """No ``groups``: the data-parallel group of the DDP whose gradient hooks sit on the parameters
    is found, so an inf on one rank makes both skip; with ``groups=[]`` only that rank skips."""
    assert run(_ddp_inf, ranks=2, inject_rank=1, groups="default") == [([True], False)] * 2
    assert run(_ddp_inf, ranks=2, inject_rank=1, groups="none") == [([], True), ([], False)]


def test_low_precision_gradient_all_reduce_halves_the_bytes():
    def fn(comm, dtype):
        mp = MixedPrecision(GPT(CFG), dtype)
        idx = np.zeros((1, 8), dtype=np.int64)
        mp.backward(mp.loss(idx, idx))
        with measure(comm) as m:
            mp.all_reduce_grads(comm)
        return m.bytes_sent
    fp32 = run(fn, ranks=2, dtype="fp32")[0]
    bf16 = run(fn, ranks=2, dtype="bf16")[0]
    assert bf16 * 2 == fp32


class _RecordingOptimizer:
    """Stands in for an optimizer: ``step()`` keeps a copy of the gradients it was handed."""

    def __init__(self, params):
        self.params, self.grads = params, None

    def step(self):
        self.grads = [np.array(m.grad) for m in self.params]


@pytest.mark.parametrize("dtype,tol", [("fp16", 1e-2), ("bf16", 5e-2)])
def test_step_hands_the_optimizer_unscaled_fp32_gradients(dtype, tol):
    """Elementwise against the fp32 model's gradients (same initial weights): the masters' gradients
    are unscaled (fp16's loss scale S = 2^16 divided out) and fp32. Stated tolerance: within tol of the
    largest gradient of the same tensor (observed 1.4e-3 for fp16, 1.2e-2 for bf16)."""
    idx = np.random.default_rng(0).integers(0, 32, (4, 16))
    ref = GPT(CFG)
    ref.loss(idx, idx).backward()
    mp = MixedPrecision(GPT(CFG), dtype)
    assert mp.scale == (2.0 ** 16 if dtype == "fp16" else 1.0)
    opt = _RecordingOptimizer(mp.master_params)
    mp.backward(mp.loss(idx, idx))
    assert mp.step(opt)
    for (name, p), g in zip(ref.named_parameters(), opt.grads):
        assert g.dtype == np.float32, name
        np.testing.assert_allclose(g, p.grad, rtol=0, atol=tol * np.abs(p.grad).max(), err_msg=name)


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_all_reduce_grads_returns_the_mean(p, dtype):
    """Each rank's low-precision gradients differ (its own rows); afterwards every rank holds their
    mean -- written out here from the gathered local gradients -- not their sum."""
    def fn(comm):
        mp = MixedPrecision(GPT(CFG), dtype)
        idx = np.random.default_rng(comm.rank).integers(0, 32, (2, 8))
        mp.backward(mp.loss(idx, idx))
        local = [np.array(q.grad, np.float32) for q in mp.params]
        mp.all_reduce_grads(comm)
        return local, [np.array(q.grad, np.float32) for q in mp.params], [q.grad.dtype for q in mp.params]

    results = run(fn, ranks=p)
    rtol = 1e-6 if dtype == "fp32" else 2.0 ** -6  # bf16: 8 bits of mantissa, rounded at every add
    for _, reduced, dtypes in results:
        assert set(dtypes) == {low_dtype(dtype)}  # still low precision: that is the point
        for k, got in enumerate(reduced):
            locals_k = [r[0][k] for r in results]
            want = sum(locals_k) / p
            scale = max(np.abs(a).max() for a in locals_k)
            np.testing.assert_allclose(got, want, rtol=0, atol=rtol * scale, err_msg=f"parameter {k}")


@pytest.mark.parametrize("dtype,tol", [("fp16", 2e-4), ("bf16", 2e-3)])
def test_data_parallel_mixed_precision_sgd_tracks_fp32_serial(dtype, tol):
    """Plain SGD (not scale-invariant like AdamW): 2 ranks with half the batch each, low-precision
    gradients averaged by ``all_reduce_grads``, 3 steps at lr 0.1; the fp32 masters stay within tol of
    the serial fp32 run (whose weights move by ~5e-2). A sum instead of a mean, or a missing unscale,
    moves them 2x or 65536x as far."""
    idx = np.random.default_rng(0).integers(0, 32, (4, 16))
    ref = GPT(CFG)
    ref_opt = SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        ref.loss(idx, idx).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    want = [np.array(q.data) for q in ref.parameters()]

    def fn(comm):
        mp = MixedPrecision(GPT(CFG), dtype)
        opt = SGD(mp.master_params, lr=0.1)
        rows = idx[2 * comm.rank:2 * comm.rank + 2]
        for _ in range(3):
            mp.backward(mp.loss(rows, rows))
            mp.all_reduce_grads(comm)
            assert mp.step(opt)
        return [np.array(m.data) for m in mp.master_params]

    for got in run(fn, ranks=2):
        assert max(np.abs(a - b).max() for a, b in zip(got, want)) < tol


def _tp_train(comm, dtype, steps, idx, lr=1e-3):
    from minidist.parallel.tensor.gpt import TPGPT

    model = TPGPT(CFG, comm, sequence_parallel=True)
    mp = MixedPrecision(model, dtype, groups=[comm])  # loss: model.loss_fn, vocabulary-parallel
    # autocast wraps LayerNorm (fp32 statistics) and the qkv projection (fp32 output for the softmax);
    # the TP linears need nothing: ops.linear of bf16 weights accumulates in fp32 by itself
    patched = [type(m).__name__ for _, m in model.named_modules() if m.forward_wrapper("autocast")]
    opt = AdamW(mp.master_params, lr=lr)
    losses = mixed_steps(mp, opt, steps, idx)
    return losses, {m.name: m.data for m in mp.master_params}, patched, mp.model(idx[:, :2]).dtype


def test_bf16_tensor_parallel_training_stays_close_to_fp32_serial():
    """TP (tp=2, sequence parallel): the column/row-parallel linears run in bf16 with fp32
    accumulation and the vocabulary-parallel loss is used; the same stated tolerance as the serial
    test above against the fp32 *serial* model (its weights sliced as TP slices them)."""
    from minidist.parallel.tensor.gpt import TPGPT
    from minidist.parallel.tensor.sharding import shard_state_dict, sharding_table

    table = run(lambda comm: sharding_table(TPGPT(CFG, comm)), ranks=1)[0]
    idx = np.random.default_rng(0).integers(0, 32, (4, 16))
    ref_losses, ref_params = _train("fp32", 6, idx)
    ref_sd = dict(zip(GPT(CFG).state_dict(), ref_params))
    for rank, (losses, params, patched, out_dtype) in enumerate(run(_tp_train, ranks=2, dtype="bf16", steps=6,
                                                                    idx=idx)):
        assert {"ColumnParallelLinear", "LayerNorm"} <= set(patched)  # the qkv projection, the norms
        assert out_dtype == low_dtype("bf16")
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-2)
        ref = shard_state_dict(ref_sd, table, rank, 2)
        diffs = np.concatenate([np.abs(params[n] - ref[n]).ravel() for n in params])
        assert diffs.max() < 2 * 6 * 1e-3 and diffs.mean() < 1e-4
        assert losses[-1] < losses[0]


def _tp_inf_rank(comm, inject_rank):
    from minidist.parallel.tensor.gpt import TPGPT

    mp = MixedPrecision(TPGPT(CFG, comm), "fp16", groups=[comm])
    opt = AdamW(mp.master_params, lr=1e-3)
    before = [m.data.copy() for m in mp.master_params]
    idx = np.random.default_rng(0).integers(0, 32, (2, 8))
    mp.backward(mp.loss(idx, idx))
    if comm.rank == inject_rank:
        mp.params[5].grad = np.full_like(mp.params[5].grad, np.inf)
    stepped = mp.step(opt)
    return stepped, mp.scale, all(np.array_equal(a, m.data) for a, m in zip(before, mp.master_params))


@pytest.mark.parametrize("inject_rank", [0, 1])
def test_injected_inf_on_one_tensor_parallel_rank_makes_the_group_skip(inject_rank):
    assert run(_tp_inf_rank, ranks=2, inject_rank=inject_rank) == [(False, 2.0 ** 15, True)] * 2


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
def test_injected_inf_under_mpirun():
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("MINIDIST_TRANSPORT", None)
    code = ("from minidist.comm import run\nfrom tests.parallel.memory.test_precision import _inf_gathered\n"
            "run(_inf_gathered, inject_rank=2, agree=True)")
    res = subprocess.run(["mpirun", "-n", "4", sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("RESULT (False, 32768.0, True, 0)") == 4, res.stdout


def test_checkpointing_composes_with_autocast():
    from minidist.parallel.memory.recompute import apply_checkpointing

    idx = np.random.default_rng(0).integers(0, 32, (2, 16))
    grads = []
    for policy in ("none", "full", "selective"):
        mp = MixedPrecision(apply_checkpointing(GPT(CFG), policy), "bf16")
        mp.backward(mp.loss(idx, idx))
        grads.append([p.grad for p in mp.params])
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            np.testing.assert_array_equal(a, b)


def test_lesson_runs_and_passes(capsys):
    from minidist.lessons import mixed_precision

    mixed_precision.main(["--ranks", "2", "--dim", "16", "--seq", "8", "--layers", "1"])
    out = capsys.readouterr().out
    assert out.count("PASS") == 4 and "FAIL" not in out
    assert "   3    " in out and "-  -" in out  # the skipped steps in the loss-scale timeline


def _dp_tp_inf(comm, inject_rank, groups):
    """dp x tp = 2 x 2: a TPGPT on the tp group, low-precision gradients averaged over dp, an inf put
    into one rank's gradient *after* the all-reduce (so only that rank sees it), then the step."""
    from minidist.comm import Mesh
    from minidist.parallel.tensor.gpt import TPGPT

    mesh = Mesh(comm, dp=2, tp=2)
    kw = {} if groups == "default" else {"groups": []}
    mp = MixedPrecision(TPGPT(CFG, mesh.tp), "fp16", **kw)
    opt = SGD(mp.master_params, lr=0.1)
    idx = np.random.default_rng(mesh.dp_rank).integers(0, 32, (2, 8))
    mp.backward(mp.loss(idx, idx))
    mp.all_reduce_grads(mesh.dp)
    if comm.rank == inject_rank:
        g = mp.params[0].grad.copy()
        g.flat[0] = np.inf
        mp.params[0].grad = g
    stepped = mp.step(opt)
    return mesh.tp_rank, stepped, mp.scale, {m.name: m.data.copy() for m in mp.master_params}


@pytest.mark.parametrize("inject_rank", [0, 3])
def test_inf_on_one_rank_of_dp_x_tp_is_agreed_by_default(inject_rank):
    """No ``groups`` given: the flag is agreed over the TP group found in the model and the DP group
    given to ``all_reduce_grads``, so every rank skips and the replicas stay identical."""
    results = run(_dp_tp_inf, ranks=4, inject_rank=inject_rank, groups="default")
    assert [r[1:3] for r in results] == [(False, 2.0 ** 15)] * 4
    for tp_rank in (0, 1):
        a, b = [r[3] for r in results if r[0] == tp_rank]
        assert all(np.array_equal(a[n], b[n]) for n in a)
    # narrowed explicitly to no agreement, the bad rank alone skips and its replica diverges
    narrowed = run(_dp_tp_inf, ranks=4, inject_rank=inject_rank, groups="none")
    assert [r[1] for r in narrowed] == [r != inject_rank for r in range(4)]


def test_mixed_precision_imports_no_other_technique():
    """Precision imports comm, nn, autograd, accel and its own files: no data parallelism (a DDP's
    group is found through its gradient hooks), no compression, no composition layer."""
    import ast

    from minidist.parallel.memory import autocast, loss_scale, precision

    for mod in (precision, autocast, loss_scale):
        tree = ast.parse(Path(mod.__file__).read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        other = {m for m in imported if m and m.startswith("minidist.parallel")
                 and not m.startswith("minidist.parallel.memory")}
        assert not other, f"{mod.__name__} imports {other}"
