"""Bucketed KV-cache reads on JAX: the same logits as NumPy's exact reads across every bucket edge,
and decoding 2^k + 1 tokens compiles a program per bucket, not one per token."""

import numpy as np
import pytest

from minidist.autograd.tensor import no_grad
from minidist.infer import Decoder, KVCache, PagedKVCache, forward_tokens, generate, generate_recompute
from minidist.infer.buckets import array_where, bucket
from minidist.nn import GPT, GPTConfig


def test_bucket_is_the_next_power_of_two_capped_at_the_cache():
    table = {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 8: 8, 9: 16, 16: 16, 17: 32, 33: 40, 40: 40}
    assert {n: bucket(n, 40) for n in table} == table
    with pytest.raises(ValueError, match="length >= 1"):
        bucket(0, 40)


def test_a_writes_rows_positions_and_take_become_index_arrays():
    (rows, pos), take = array_where(3, np.int64(7), (0, 0), 1)  # one sequence decoding
    assert rows.shape == pos.shape == () and (int(rows), int(pos)) == (3, 7) and take == (0, 0)
    (rows, pos), take = array_where(np.array([2, 0]), np.array([5, 9]), (slice(None), 0), 2)
    assert rows.tolist() == [2, 0] and pos.tolist() == [5, 9]
    assert take[0].tolist() == [0, 1] and take[1] == 0


def _chunked_logits(dec, cache, seqs, rounds):
    """Feed the sequences ``seqs`` in rounds: round r gives sequence i its next ``rounds[r][i]``
    tokens (0: it sits out). Every position's logits, per sequence, on the host."""
    got, pos = [[] for _ in seqs], [0] * len(seqs)
    with no_grad():
        for sizes in rounds:
            rows = [i for i, n in enumerate(sizes) if n]
            feed = [seqs[i][pos[i]:pos[i] + sizes[i]] for i in rows]
            out = np.asarray(forward_tokens(dec, cache, rows, feed))
            for r, i in enumerate(rows):
                got[i].append(out[r, :sizes[i]])
                pos[i] += sizes[i]
    return [np.concatenate(g) for g in got]


CFG = GPTConfig(vocab_size=19, block_size=48, n_layer=2, n_head=2, d_model=12, seed=5, dtype="float64")


@pytest.mark.parametrize("paged", [False, True])
def test_bucketed_jax_decoding_equals_numpys_across_bucket_edges(paged):
    """Two sequences: a 3-token and a 6-token prefill, then one token each per step to 34 and 40
    positions (the first leaves the batch 3 steps early) -- through the bucket edges 4, 8, 16, 32 --
    in float64: every position's logits equal NumPy's (which reads exactly the cached keys) to 1e-12."""
    pytest.importorskip("jax")
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 19, 34).tolist(), rng.integers(0, 19, 40).tolist()]
    rounds = [(3, 6)] + [(1, 1)] * 31 + [(0, 1)] * 3
    assert [sum(r[i] for r in rounds) for i in range(2)] == [34, 40]
    out = {}
    for backend in ("numpy", "jax"):
        model = GPT(CFG, backend=backend)
        dec = Decoder.from_model(model)
        if paged:
            cache = PagedKVCache.for_decoder(dec, 2, num_blocks=12, block_len=8)
            for i, s in enumerate(seqs):
                cache.reserve(i, len(s))
        else:
            cache = KVCache.for_decoder(dec, 2)
        out[backend] = _chunked_logits(dec, cache, seqs, rounds)
    for i in range(2):
        assert out["jax"][i].shape == out["numpy"][i].shape == (len(seqs[i]), 19)
        np.testing.assert_allclose(out["jax"][i], out["numpy"][i], rtol=0, atol=1e-12, err_msg=f"seq {i}")


def test_decoding_2k_plus_1_tokens_compiles_a_program_per_bucket_not_per_token():
    """After one warm-up token, decoding 33 = 2^5 + 1 more reads keys in buckets 2, 4, ..., 64 and
    writes at 33 positions: a few programs per bucket (the read, the attention), one write for every
    position -- not the ~10 per token of exact shapes. A second decode through the same buckets
    compiles nothing."""
    jax = pytest.importorskip("jax")  # noqa: F841
    from minidist.accel import jax_engine

    if not jax_engine.enabled():
        pytest.skip("MINIDIST_JAX_JIT=0: nothing is compiled")
    cfg = GPTConfig(vocab_size=23, block_size=64, n_layer=2, n_head=2, d_model=14, seed=6, dtype="float64")
    model = GPT(cfg, backend="jax")
    dec = Decoder.from_model(model)

    def decode(n):
        cache = KVCache.for_decoder(dec, 1)
        with no_grad():
            forward_tokens(dec, cache, [0], [[1]])
            forward_tokens(dec, cache, [0], [[2]])  # the decode step's ops, at bucket 2
            before = jax_engine.compilations()
            for t in range(n):
                forward_tokens(dec, cache, [0], [[t % 23]])
        return jax_engine.compilations() - before

    first = decode(33)  # tk = 3 .. 35: buckets 4, 8, 16, 32, 64
    assert 0 < first <= 3 * 5, f"decoding 33 tokens compiled {first} programs (5 buckets)"
    assert decode(33) == 0


def test_generate_on_jax_gives_numpys_tokens_and_logits_past_a_bucket_edge():
    """``generate`` and its recompute twin, greedy, float64: a 5-token prompt plus 12 new tokens (keys
    6 .. 17: buckets 8, 16 and the cache's 17; the prefill padded to 8, the recompute's windows to
    8, 16, 32) -- the same tokens as NumPy, logits within 1e-12."""
    pytest.importorskip("jax")
    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    want_toks, want_logits = generate(GPT(CFG), prompts, 12, return_logits=True)
    jm = GPT(CFG, backend="jax")
    toks, logits = generate(jm, prompts, 12, return_logits=True)
    slow, slow_logits = generate_recompute(jm, prompts, 12, return_logits=True)  # padded windows
    assert toks == slow == want_toks
    for a, b, c in zip(logits, slow_logits, want_logits):
        np.testing.assert_allclose(a, c, rtol=0, atol=1e-12)
        np.testing.assert_allclose(b, c, rtol=0, atol=1e-12)


def test_the_train_lessons_sampling_pads_its_window_on_jax_and_gives_numpys_tokens():
    """Lesson 1 samples by recomputing the window; on JAX the window is padded to a power of two,
    which causal attention keeps from changing the real positions: the same tokens as NumPy's
    (float64); once windows of 4, 8 and 16 tokens have run, windows of 3 .. 15 compile nothing."""
    pytest.importorskip("jax")
    from minidist.accel import jax_engine
    from minidist.lessons.train import sample

    cfg = GPTConfig(vocab_size=30, block_size=16, n_layer=1, n_head=2, d_model=10, seed=3, dtype="float64")
    jm = GPT(cfg, backend="jax")
    for n in (4, 8, 16):
        sample(jm, list(range(n)), 1)
    before = jax_engine.compilations()
    assert sample(jm, [4, 5, 6], 13, seed=2) == sample(GPT(cfg), [4, 5, 6], 13, seed=2)
    if jax_engine.enabled():
        assert jax_engine.compilations() == before


def test_a_prompt_is_padded_on_a_whole_decoder_but_not_on_a_pipeline_stage():
    """On JAX a whole model's prefill pads 3 tokens to 4 (one program for lengths 3 and 4); a
    pipeline stage (no head: it sends its hidden states on) does not pad, so it sends the bytes of
    3 tokens, what the ledger's formula counts."""
    pytest.importorskip("jax")
    model = GPT(CFG, backend="jax")
    layers = list(model)
    whole, stage = Decoder.from_model(model), Decoder(CFG, layers[1:-1], embed=layers[0])
    assert whole.whole and not stage.whole
    out_whole = forward_tokens(whole, KVCache.for_decoder(whole, 1), [0], [[1, 2, 3]])
    out_stage = forward_tokens(stage, KVCache.for_decoder(stage, 1), [0], [[1, 2, 3]])
    assert out_whole.shape == (1, 4, CFG.vocab_size) and out_stage.shape == (1, 3, CFG.d_model)
