"""Sharded serving (tensor-parallel heads + MLP, pipeline stages) gives one process's tokens."""

import os
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist.comm import Mesh, run
from minidist.infer import SamplingParams, generate, shard_for, sharded_generate
from minidist.nn import GPT, GPTConfig

V = 32
ROOT = Path(__file__).resolve().parents[2]


@cache
def model(n_layer=3):
    return GPT(GPTConfig(vocab_size=V, block_size=40, n_layer=n_layer, n_head=4, d_model=32, seed=3))


@given(prompts=st.lists(st.lists(st.integers(0, V - 1), min_size=1, max_size=10), min_size=1, max_size=3),
       new=st.integers(1, 8), mesh=st.sampled_from([(2, 1), (4, 1), (1, 2), (1, 3), (2, 2)]),
       temperature=st.sampled_from([0.0, 1.0]))
def test_sharded_equals_single_process(prompts, new, mesh, temperature):
    tp, pp = mesh
    sp = SamplingParams(temperature=temperature, top_p=0.9, seed=1)
    ref, ref_logits = generate(model(), prompts, new, sp, return_logits=True)
    res = run(lambda c: sharded_generate(c, model(), prompts, new, sp, tp=tp, pp=pp, return_logits=True),
              ranks=tp * pp)
    for toks, _ in res:
        assert toks == ref
    sampler = (pp - 1) * tp
    for a, b in zip(res[sampler][1], ref_logits):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_sharded_serving_runs_trainings_parallel_blocks_on_their_shards():
    """tp=2: each rank serves with ParallelBlocks holding exactly its training shard, written out:
    heads 2r, 2r+1 (columns 16r..16r+15 of each of q, k, v), rows 64r.. of the MLP's projection,
    the replicated attention-projection bias; the embedding and head are the serial model's own."""
    m = model()

    def rank(comm):
        dec = shard_for(Mesh(comm, dp=1, pp=1, tp=2), m)
        b = dec.blocks[1]
        return (type(b).__name__, dec.embed is m[0], dec.head is m[-1], b.attn.qkv.weight.numpy(),
                b.attn.qkv.bias.numpy(), b.mlp.proj.weight.numpy(), b.attn.proj.bias.numpy(), dec.cache_dims)

    serial = m[2]
    for r, (name, embed, head, qkv_w, qkv_b, proj, bias, dims) in enumerate(run(rank, ranks=2)):
        cols = [c for part in range(3) for c in range(32 * part + 16 * r, 32 * part + 16 * (r + 1))]
        assert name == "ParallelBlock" and embed and head and dims == (3, 2, 8)
        np.testing.assert_array_equal(qkv_w, serial.attn.qkv.weight.numpy()[:, cols])
        np.testing.assert_array_equal(qkv_b, serial.attn.qkv.bias.numpy()[cols])
        np.testing.assert_array_equal(proj, serial.mlp.proj.weight.numpy()[64 * r:64 * (r + 1)])
        np.testing.assert_array_equal(bias, serial.attn.proj.bias.numpy())


@pytest.mark.parametrize("n_kv_head, tp, heads", [(None, 2, 2), (2, 1, 2), (2, 2, 1), (1, 2, 1), (1, 1, 1)])
def test_cache_dims_are_the_kv_heads_a_rank_caches(n_kv_head, tp, heads):
    """The cache per slot and position holds K/V heads, not query heads: n_head = 4 over tp ranks,
    K = n_kv_head split when tp divides it (2 over 2: one each), replicated when not (MQA: 1 each);
    the cache built for the decoder has that many heads."""
    from minidist.infer import KVCache

    m = GPT(GPTConfig(vocab_size=V, block_size=40, n_layer=2, n_head=4, d_model=32, seed=3,
                      n_kv_head=n_kv_head))

    def rank(comm):
        dec = shard_for(Mesh(comm, dp=1, pp=1, tp=tp), m)
        return dec.cache_dims, KVCache.for_decoder(dec, 1).k[0].shape[1]

    for dims, cached in run(rank, ranks=tp):
        assert dims == (2, heads, 8) and cached == heads


def test_a_sequence_parallel_block_refuses_a_cache():
    from minidist.autograd.tensor import Tensor, no_grad
    from minidist.infer import CacheStep, Decoder, KVCache
    from minidist.parallel.tensor.gpt import ParallelBlock

    cfg = model().config
    cache = KVCache.for_decoder(Decoder.from_model(model()), 1)
    step = CacheStep(cache, np.array([0]), np.array([[0, 1]]), np.ones((1, 2), bool))

    def rank(comm):
        block = ParallelBlock(cfg, comm, np.random.default_rng(0), sequence_parallel=True)
        with no_grad():
            block(Tensor(np.zeros((1, 1, cfg.d_model), np.float32)), cache=step.layer(0))

    with pytest.raises(ValueError, match=r"rank \d: a KV cache needs the whole sequence"):
        run(rank, ranks=2)


def test_sharded_errors():
    with pytest.raises(ValueError, match="n_head 4 is not divisible by tp 3"):
        run(lambda c: sharded_generate(c, model(), [[1]], 2, tp=3), ranks=3)
    with pytest.raises(ValueError, match="cannot cut 3 layers into 4 pipeline stages"):
        run(lambda c: sharded_generate(c, model(), [[1]], 2, pp=4), ranks=4)
    with pytest.raises(ValueError, match=r"rank \d: .*cannot cut 3 layers"):
        run(lambda c: sharded_generate(c, model(), [[1]], 2, pp=4), ranks=4)
    with pytest.raises(ValueError, match=r"rank \d: prompt 0 is empty"):
        run(lambda c: sharded_generate(c, model(), [[]], 2, tp=2), ranks=2)
    with pytest.raises(ValueError, match=r"rank \d: prompt 0 has 41 tokens, longer than the context"):
        run(lambda c: sharded_generate(c, model(), [[1] * 41], 2, pp=2), ranks=2)
    with pytest.raises(ValueError, match=r"rank \d: no prompts"):
        run(lambda c: sharded_generate(c, model(), [], 2, tp=2, pp=2), ranks=4)
    with pytest.raises(ValueError, match=r"rank \d: prompt 1 has token id 32 .* vocab_size 32"):
        run(lambda c: sharded_generate(c, model(), [[1], [V]], 2, tp=2), ranks=2)


PROGRAM = """
import sys
from minidist.comm import run
from minidist.infer import generate, sharded_generate
from minidist.nn import GPT, GPTConfig
tp, pp = int(sys.argv[1]), int(sys.argv[2])
m = GPT(GPTConfig(vocab_size=32, block_size=40, n_layer=3, n_head=4, d_model=32, seed=3))
prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
(out,) = run(lambda c: (c.rank, sharded_generate(c, m, prompts, 12, tp=tp, pp=pp)))
assert out[1] == generate(m, prompts, 12), (out, generate(m, prompts, 12))
print(f"OK rank {out[0]}", flush=True)
"""


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun (pip install mpich)")
@pytest.mark.parametrize("tp,pp", [(2, 1), (2, 2)])
def test_sharded_under_mpirun(tp, pp):
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("MINIDIST_TRANSPORT", None)
    res = subprocess.run(["mpirun", "-n", str(tp * pp), sys.executable, "-c", PROGRAM, str(tp), str(pp)],
                         capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("OK rank") == tp * pp


def test_lesson_runs_on_threads(capsys):
    from minidist.lessons import inference

    assert all(inference.main(["--ranks", "8", "--steps", "5", "--d-model", "32"]))
    out = capsys.readouterr().out
    assert "mesh tp=4 x pp=2" in out and "FAIL" not in out and "all checks: PASS" in out
    assert "4. speculative decoding: a 1-layer early-exit draft proposes k=4" in out
    assert "disaggregated (4 : 4)" in out  # the default: half the ranks prefill
    assert "3b. prefix caching" in out and "3c. KV cache bytes per token" in out


@pytest.mark.parametrize("flags,message", [
    (["--disaggregate", "1:2"], "argument --disaggregate: 1:2 uses 3 ranks, the run has 4"),
    (["--disaggregate", "2"], "argument --disaggregate: give P:D"),
    (["--disaggregate", "0:4"], "each >= 1"),
    (["--draft-layers", "3"], "argument --draft-layers: the draft must not be bigger than the target's"),
    (["--speculative", "-1"], "argument --speculative: must be an integer >= 0"),
])
def test_lesson_flags_are_checked_before_any_rank_starts(flags, message, capsys):
    from minidist.lessons import inference

    with pytest.raises(SystemExit) as info:
        inference.main(["--ranks", "4", *flags])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and not any("trained" in line for line in err)


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun (pip install mpich)")
def test_lesson_under_mpirun():
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("MINIDIST_TRANSPORT", None)
    cmd = ["mpirun", "-n", "2", sys.executable, "-m", "minidist.lessons.inference", "--steps", "5",
           "--d-model", "32", "--kv-heads", "2", "--kv-dtype", "int8"]  # GQA: 2 K/V heads, one per tp rank
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "all checks: PASS" in res.stdout and "mesh tp=2 x pp=1" in res.stdout
    assert "disaggregated (1 : 1)" in res.stdout
    assert "K = 2 K/V heads" in res.stdout and "int8 (--kv-dtype int8)" in res.stdout
