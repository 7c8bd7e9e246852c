"""Activation recomputation: gradients bit-identical to the plain model (dropout on),
also under DDP, inside pipeline stages and tensor-parallel models; measured peak activation bytes
equal the formula; clear errors."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from minidist.autograd import random as mrandom
from minidist.autograd.tensor import Tensor
from minidist.comm import measure, run
from minidist.nn import Linear, Sequential
from minidist.nn.footprint import MemoryAccountant
from minidist.nn.gpt import GPT, GPTConfig
from minidist.parallel.data.ddp import DistributedDataParallel
from minidist.parallel.memory.recompute import (
    POLICIES,
    POSITION,
    apply_recompute,
    check_segments_within,
    predicted_peak_activation_bytes,
    recompute,
    recompute_stage,
    remove_recompute,
)
from minidist.parallel.pipeline.catalog import make_schedule
from minidist.parallel.pipeline.partition import partition_uniform
from minidist.parallel.pipeline.runtime import run_schedule, split_microbatches
from minidist.parallel.pipeline.stage import PipelineStage
from tests.conftest import backends


def _grads(cfg, policy, idx, tgt, k=None, seed=7):
    model = apply_recompute(GPT(cfg), policy, k=k)
    mrandom.manual_seed(seed)
    meter = MemoryAccountant()
    with meter.track_activations(model):
        loss = model.loss(idx, tgt)
        loss.backward()
    after = mrandom.default_generator().random()  # the RNG stream continues as without recompute
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}, meter, after


@given(n_layer=st.integers(1, 5), n_head=st.sampled_from([1, 2]), t=st.integers(2, 9),
       b=st.integers(1, 3), policy=st.sampled_from(POLICIES), k=st.integers(1, 3),
       dropout=st.sampled_from([0.0, 0.2]), dtype=st.sampled_from(["float32", "float64"]))
@example(n_layer=3, n_head=2, t=5, b=2, policy="full", k=1, dropout=0.2, dtype="float64")
@example(n_layer=2, n_head=1, t=9, b=1, policy="full", k=1, dropout=0.0, dtype="float32")
@example(n_layer=4, n_head=2, t=4, b=2, policy="every_k", k=2, dropout=0.2, dtype="float64")
@example(n_layer=5, n_head=2, t=3, b=3, policy="every_k", k=3, dropout=0.2, dtype="float32")  # 5 = 3 + 2
@example(n_layer=3, n_head=1, t=6, b=1, policy="every_k", k=1, dropout=0.0, dtype="float64")
def test_recomputed_gradients_equal_plain_ones_exactly(n_layer, n_head, t, b, policy, k, dropout, dtype):
    cfg = GPTConfig(vocab_size=11, block_size=9, n_layer=n_layer, n_head=n_head, d_model=8,
                    dropout=dropout, dtype=dtype)
    rng = np.random.default_rng(t * 10 + b)
    idx, tgt = rng.integers(0, 11, (b, t)), rng.integers(0, 11, (b, t))
    loss0, g0, m0, after0 = _grads(cfg, "none", idx, tgt)
    loss1, g1, m1, after1 = _grads(cfg, policy, idx, tgt, k=k)
    assert loss0 == loss1 and after0 == after1
    assert g0.keys() == g1.keys()
    for name in g0:
        np.testing.assert_array_equal(g0[name], g1[name], err_msg=f"{policy}: {name}")
    # the measured peak is the formula, byte for byte
    assert m1.peak_activation_bytes == predicted_peak_activation_bytes(cfg, b, t, policy, k=k)
    assert m0.activation_bytes == m1.activation_bytes == 0  # everything freed after backward


def test_full_recompute_cuts_peak_activations_3x():
    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=8, n_head=4, d_model=32)
    idx = np.random.default_rng(0).integers(0, 64, (2, 32))
    _, _, none, _ = _grads(cfg, "none", idx, idx)
    _, _, full, _ = _grads(cfg, "full", idx, idx)
    _, _, sqrt, _ = _grads(cfg, "sqrt", idx, idx)
    assert none.peak_activation_bytes >= 3 * full.peak_activation_bytes
    assert full.peak_activation_bytes < sqrt.peak_activation_bytes < none.peak_activation_bytes


def test_parameter_hooks_fire_once_each_inside_recomputations():
    cfg = GPTConfig(vocab_size=16, block_size=8, n_layer=3, n_head=2, d_model=8)
    model = apply_recompute(GPT(cfg), "full")
    fired = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda t, name=name: fired.append(name))
    idx = np.arange(8).reshape(1, 8) % 16
    model.loss(idx, idx).backward()
    assert sorted(fired) == sorted(n for n, _ in model.named_parameters())
    # reverse layer order: the head's grads complete before the first block's
    assert fired.index("4.proj.weight") < fired.index("1.attn.qkv.weight")


def test_data_parallel_with_recompute_matches_serial():
    """The real DistributedDataParallel: its bucket hooks fire inside the recomputation, the
    averaged gradients equal the serial model's on the whole batch."""
    cfg = GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, d_model=8, dtype="float64")
    data = np.random.default_rng(3).integers(0, 16, (4, 8))

    def rank_fn(comm):
        ddp = DistributedDataParallel(apply_recompute(GPT(cfg), "full"), comm, bucket_bytes=512)
        shard = data[2 * comm.rank: 2 * comm.rank + 2]
        ddp.backward(ddp.module.loss(shard, shard))
        ddp.wait_gradients()
        return {n: p.grad for n, p in ddp.module.named_parameters()}, ddp.started_in_backward

    got = run(rank_fn, ranks=2)
    serial = GPT(cfg)
    serial.loss(data, data).backward()
    for n, p in serial.named_parameters():
        np.testing.assert_allclose(got[0][0][n], p.grad, rtol=1e-10, atol=1e-12)
        np.testing.assert_array_equal(got[0][0][n], got[1][0][n])
    assert got[0][1] > 1  # buckets started during backward, from hooks inside the recomputation


def _pipeline_rank(comm, cfg, policy, x, y, whole_model=False):
    model = GPT(cfg)
    bounds = partition_uniform(len(model), comm.size)
    if whole_model:
        apply_recompute(model, policy)
    stage = PipelineStage(model, bounds, comm.rank, comm.size)
    for ids, chunk in zip(stage.layer_ids, stage.chunks):  # what parallelize does to a stage's chunks
        check_segments_within(chunk, ids, comm.rank)
        if not whole_model:
            recompute_stage(chunk, policy, 2)
    mrandom.manual_seed(5 + comm.rank)
    first, last = comm.rank == 0, comm.rank == comm.size - 1
    run_schedule(stage, comm, make_schedule("1f1b", comm.size, 2)[comm.rank],
                 split_microbatches(x, 2) if first else None, split_microbatches(y, 2) if last else None)
    return {n: p.grad for n, p in stage.named_parameters()}


@pytest.mark.parametrize("policy", POLICIES)
def test_pipeline_with_recompute_equals_without(policy):
    """Every policy, 3 stages over 4 blocks (segments cut at the stage boundaries), dropout on:
    every parameter of every stage has its gradient, bit-identical to the pipeline without it."""
    cfg = GPTConfig(vocab_size=16, block_size=8, n_layer=4, n_head=2, d_model=8, dropout=0.1)
    x, y = np.random.default_rng(0).integers(0, 16, (2, 4, 8))
    plain = run(_pipeline_rank, ranks=3, cfg=cfg, policy="none", x=x, y=y)
    ckpt = run(_pipeline_rank, ranks=3, cfg=cfg, policy=policy, x=x, y=y)
    for g0, g1 in zip(plain, ckpt):
        assert g0.keys() == g1.keys()
        for name in g0:
            assert g1[name] is not None, f"{policy}: {name} got no gradient"
            np.testing.assert_array_equal(g0[name], g1[name], err_msg=f"{policy}: {name}")


def test_pipeline_refuses_a_segment_across_a_stage_boundary():
    """sqrt over 4 blocks = segments (1, 2), (3, 4); 3 stages cut between blocks 1 and 2."""
    cfg = GPTConfig(vocab_size=16, block_size=8, n_layer=4, n_head=2, d_model=8)
    model = apply_recompute(GPT(cfg), "sqrt")
    stage = PipelineStage(model, partition_uniform(6, 3), 0, 3)
    with pytest.raises(ValueError, match="stage 0: layer 1 is in a recomputed segment of 2 blocks that "
                                         "crosses.*checkpoint=policy"):
        check_segments_within(stage.chunks[0], stage.layer_ids[0], 0)
    stage = PipelineStage(apply_recompute(model, "full"), partition_uniform(6, 3), 0, 3)
    check_segments_within(stage.chunks[0], stage.layer_ids[0], 0)  # 1-block segments


def _tp_rank(comm, cfg, policy, idx, sp, dropout_rng):
    from minidist.parallel.tensor.gpt import TPGPT

    model = apply_recompute(TPGPT(cfg, comm, sequence_parallel=sp, dropout_rng=dropout_rng), policy)
    mrandom.manual_seed(11)
    with measure(comm) as m:
        loss = model.loss(idx, idx)
        loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}, m.bytes_sent


@pytest.mark.parametrize("policy,sp,dropout_rng", [("full", False, "twin"), ("sqrt", True, "megatron"),
                                                   ("selective", True, "twin")])
def test_tensor_parallel_with_recompute_equals_without(policy, sp, dropout_rng):
    """TP (tp=2, threads), dropout on -- also masks from the per-rank ShardedRNG, replayed through
    ``generators=`` -- gives exactly the gradients without recomputation; recomputing a block repeats its
    forward collectives (more bytes sent), recomputing the attention core alone does not."""
    cfg = GPTConfig(vocab_size=16, block_size=8, n_layer=3, n_head=2, d_model=8, dropout=0.2)
    idx = np.random.default_rng(2).integers(0, 16, (2, 8))
    plain = run(_tp_rank, ranks=2, cfg=cfg, policy="none", idx=idx, sp=sp, dropout_rng=dropout_rng)
    ckpt = run(_tp_rank, ranks=2, cfg=cfg, policy=policy, idx=idx, sp=sp, dropout_rng=dropout_rng)
    for (l0, g0, b0), (l1, g1, b1) in zip(plain, ckpt):
        assert l0 == l1 and g0.keys() == g1.keys()
        assert b1 == b0 if policy == "selective" else b1 > b0  # the core alone has no collective
        for name in g0:
            np.testing.assert_array_equal(g0[name], g1[name], err_msg=f"{policy}: {name}")


def test_a_model_without_blocks_is_an_error():
    with pytest.raises(ValueError, match="has no transformer block"):
        apply_recompute(Sequential([Linear(2, 2)]), "full")


def test_recompute_reaches_parameters_when_no_input_needs_grad():
    lin = Linear(4, 3, dtype=np.float64, rng=np.random.default_rng(0))
    x = np.random.default_rng(1).standard_normal((5, 4))
    recompute(lin, Tensor(x)).sum().backward()
    got_w, got_b = lin.weight.grad, lin.bias.grad
    lin.zero_grad()
    lin(Tensor(x)).sum().backward()
    np.testing.assert_array_equal(got_w, lin.weight.grad)
    np.testing.assert_array_equal(got_b, lin.bias.grad)


@pytest.mark.parametrize("policy", ["full", "sqrt", "selective"])
def test_recompute_inside_a_pipeline_stage(policy):
    """A stage (a slice of the blocks) gets an activation with requires_grad and, later, the output
    gradient from the next stage: input and parameter grads equal the plain stage's exactly."""
    cfg = GPTConfig(vocab_size=16, block_size=8, n_layer=4, n_head=2, d_model=8, dropout=0.1)
    x = np.random.default_rng(0).standard_normal((2, 8, 8)).astype(np.float32)
    gy = np.random.default_rng(1).standard_normal((2, 8, 8)).astype(np.float32)
    out = []
    for pol in ("none", policy):
        stage = Sequential()
        for blk in list(GPT(cfg))[2:5]:
            stage.append(blk)
        apply_recompute(stage, pol)
        mrandom.manual_seed(3)
        xt = Tensor(x, requires_grad=True)
        stage(xt).backward(gy)
        out.append([xt.grad] + [p.grad for p in stage.parameters()])
    for a, b in zip(*out):
        np.testing.assert_array_equal(a, b)


def test_remove_recompute_restores_plain_forwards():
    model = apply_recompute(GPT(GPTConfig(vocab_size=8, block_size=4, n_layer=2, d_model=8)), "sqrt")
    remove_recompute(model)
    assert all(not m.forward_wrappers() for _, m in model.named_modules())
    apply_recompute(model, "selective")
    assert model[1].attn.forward_wrapper(POSITION) is not None
    apply_recompute(model, "none")
    assert all(not m.forward_wrappers() for _, m in model.named_modules())


def test_bad_policies_raise_clear_errors():
    model = GPT(GPTConfig(vocab_size=8, block_size=4, n_layer=2, d_model=8))
    with pytest.raises(ValueError, match="unknown recompute policy 'half'.*none, full"):
        apply_recompute(model, "half")
    with pytest.raises(ValueError, match="every_k' needs k >= 1"):
        apply_recompute(model, "every_k")
    with pytest.raises(TypeError, match="fn must return one Tensor"):
        x = Tensor(np.ones(3), requires_grad=True)
        recompute(lambda t: (t, t), x)


@pytest.mark.parametrize("backend", backends())
def test_recompute_on_every_backend(backend):
    from minidist.accel.backend import get_backend

    cfg = GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, d_model=8, dropout=0.1)
    idx = np.random.default_rng(0).integers(0, 16, (2, 8))
    grads = []
    for policy in ("none", "full"):
        model = apply_recompute(GPT(cfg, backend=get_backend(backend)), policy)
        mrandom.manual_seed(1)
        model.loss(idx, idx).backward()
        grads.append([np.asarray(get_backend(backend).to_host(p.grad)) for p in model.parameters()])
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            np.testing.assert_array_equal(a, b)


def test_lesson_runs_and_passes(capsys):
    from minidist.lessons import checkpointing

    checkpointing.main(["--ranks", "2", "--layers", "3", "--dim", "16", "--seq", "16", "--batch", "2",
                        "--repeats", "1"])
    out = capsys.readouterr().out
    assert out.count("PASS") == 4 and "FAIL" not in out


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
def test_lesson_under_mpirun():
    root = Path(__file__).resolve().parents[3]
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(root))
    env.pop("MINIDIST_TRANSPORT", None)
    cmd = ["mpirun", "-n", "2", sys.executable, "-m", "minidist.lessons.checkpointing", "--layers", "2",
           "--dim", "16", "--seq", "16", "--batch", "2", "--repeats", "1"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=root)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("PASS") == 4 and "FAIL" not in res.stdout and "(mpi)" in res.stdout


def test_selective_recompute_of_grouped_query_attention_is_refused_by_name():
    """Selective recomputation re-runs a multi-head core; a grouped-query model is refused (not a
    silently wrong split of its q|k|v)."""
    from minidist.nn import GPT, GPTConfig

    gqa = GPT(GPTConfig(vocab_size=11, block_size=6, n_layer=1, n_head=4, n_kv_head=1, d_model=8))
    with pytest.raises(ValueError, match=r"selective.*grouped-query.*n_kv_head=1 < n_head=4.*'full'"):
        apply_recompute(gqa, "selective")
    apply_recompute(gqa, "full")  # the whole block recomputes: fine


def test_the_old_checkpointing_names_are_the_recompute_api():
    """"checkpoint" now means saved state only; the names from before stay importable as aliases."""
    from minidist.parallel.memory import recompute as R

    old = (R.apply_checkpointing, R.remove_checkpointing, R.checkpoint_stage, R.checkpoint, R.Checkpoint)
    assert old == (R.apply_recompute, R.remove_recompute, R.recompute_stage, R.recompute, R.Recompute)


def test_recompute_imports_no_other_technique():
    """Recomputation knows blocks by their shape: it imports nn and autograd, no technique and no
    composition layer (which pairs it joins is parallelize's table)."""
    import ast

    from minidist.parallel.memory import recompute as R

    tree = ast.parse(Path(R.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert {m for m in imported if m and m.startswith("minidist.parallel")} == \
        {"minidist.parallel.memory.recompute_policy"}
