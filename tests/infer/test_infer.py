"""KV-cached decoding against full recompute; batched generation; sampling; clear errors."""

from functools import cache

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist.autograd.tensor import Tensor, no_grad
from minidist.infer import (
    Decoder,
    KVCache,
    PagedKVCache,
    SamplingParams,
    filter_probs,
    forward_tokens,
    full_logits,
    generate,
    generate_recompute,
)
from minidist.infer.kv_cache import CacheStep, causal_mask
from minidist.nn import GPT, GPTConfig
from minidist.nn.attention import masked_attention

V, BLOCK = 32, 40


@cache
def model(n_head=4, n_layer=2, d=32, n_kv_head=None):
    return GPT(GPTConfig(vocab_size=V, block_size=BLOCK, n_layer=n_layer, n_head=n_head, d_model=d, seed=1,
                         n_kv_head=n_kv_head))


seqs = st.lists(st.lists(st.integers(0, V - 1), min_size=1, max_size=24), min_size=1, max_size=3)


@given(seqs=seqs, data=st.data())
def test_cached_logits_equal_full_recompute(seqs, data):
    """Feed each sequence in random chunks (prefill split anywhere, then decodes): every position's
    logits equal the training-time forward over the whole sequence -- with multi-head, grouped-query
    and multi-query attention, in the contiguous and the paged cache."""
    kv = data.draw(st.sampled_from([None, 2, 1]), label="n_kv_head")
    m = model(n_kv_head=kv)
    w = Decoder.from_model(m)
    if data.draw(st.booleans(), label="paged"):
        cache = PagedKVCache.for_decoder(w, len(seqs), num_blocks=3 * len(seqs) * 4, block_len=3)
        for i, s in enumerate(seqs):
            cache.reserve(i, len(s))
    else:
        cache = KVCache.for_decoder(w, len(seqs))
    # K/V heads cached: 2 (k, v) · layers · kv heads · head_dim · 4 bytes per token
    assert cache.bytes_per_token() == 2 * 2 * (kv or 4) * 8 * 4
    got = [[] for _ in seqs]
    pos = [0] * len(seqs)
    with no_grad():
        while any(p < len(s) for p, s in zip(pos, seqs)):
            rows = [i for i, s in enumerate(seqs) if pos[i] < len(s)]
            chunks = []
            for i in rows:
                n = data.draw(st.integers(1, len(seqs[i]) - pos[i]))
                chunks.append(seqs[i][pos[i]:pos[i] + n])
                pos[i] += n
            logits = forward_tokens(w, cache, rows, chunks)
            for r, (i, c) in enumerate(zip(rows, chunks)):
                got[i].append(logits[r, :len(c)])
    for i, s in enumerate(seqs):
        np.testing.assert_allclose(np.concatenate(got[i]), full_logits(m, s), atol=2e-5, rtol=1e-4)
        assert cache.lengths[i] == len(s)


def test_cached_attention_mask_by_hand():
    """Queries after cached keys: row 0's 3 queries sit at positions 4-6 of 7 keys (the causal mask
    shifted by Tk - Tq = 4), row 1's at 0-2 (a shorter sequence in the same batch). Written out:
    query at position p attends to keys 0..p only."""
    rng = np.random.default_rng(0)
    b, h, tq, tk, d = 2, 3, 3, 7, 4
    q = rng.standard_normal((b, h, tq, d))
    k, v = rng.standard_normal((b, h, tk, d)), rng.standard_normal((b, h, tk, d))
    qpos = np.array([[4, 5, 6], [0, 1, 2]])
    got = masked_attention(q, k, v, causal_mask(np, qpos, tk))
    for r in range(b):
        for head in range(h):
            for i in range(tq):
                n = qpos[r, i] + 1
                s = k[r, head, :n] @ q[r, head, i] / np.sqrt(d)
                p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
                np.testing.assert_allclose(got[r, head, i], p @ v[r, head, :n], rtol=1e-12, atol=1e-12)
    assert causal_mask(np, np.array([[6], [6]]), 7) is None  # decoding at the newest key hides nothing


def test_block_with_a_cache_refuses_to_record_a_graph():
    m = model()
    cache = KVCache.for_decoder(Decoder.from_model(m), 1)
    step = CacheStep(cache, np.array([0]), np.array([[0]]), np.ones((1, 1), bool))
    x = Tensor(np.zeros((1, 1, 32), np.float32), requires_grad=True)
    with pytest.raises(RuntimeError, match="KV cache is for inference; run it under .*no_grad"):
        m[1](x, cache=step.layer(0))


def test_serving_a_model_with_dropout_in_training_mode_is_refused():
    m = GPT(GPTConfig(vocab_size=V, block_size=BLOCK, n_layer=1, n_head=2, d_model=16, dropout=0.2, seed=4))
    with pytest.raises(ValueError, match=r"dropout 0.2 and is in training mode: call model.eval\(\)"):
        generate(m, [[1, 2]], 3)
    m.eval()
    assert generate(m, [[1, 2]], 6) == generate_recompute(m, [[1, 2]], 6)


@given(prompts=st.lists(st.lists(st.integers(0, V - 1), min_size=1, max_size=10), min_size=1, max_size=3),
       new=st.integers(1, 12))
def test_generate_equals_recompute_greedy(prompts, new):
    a, la = generate(model(), prompts, new, return_logits=True)
    b, lb = generate_recompute(model(), prompts, new, return_logits=True)
    assert a == b
    for x, y in zip(la, lb):
        np.testing.assert_allclose(x, y, atol=2e-5, rtol=1e-4)


def test_cache_works_on_jax_too():
    """JAX arrays are immutable: the caches write with Backend.set_at (a new array per step) and
    still give the recompute's tokens, contiguous and paged."""
    pytest.importorskip("jax")
    cfg = GPTConfig(vocab_size=V, block_size=BLOCK, n_layer=1, n_head=2, d_model=16, seed=2)
    jm = GPT(cfg, backend="jax")
    prompts = [[1, 2, 3], [4, 5]]
    want = generate(GPT(cfg), prompts, 4)
    assert generate(jm, prompts, 4) == want
    from minidist.infer import Request, serve

    tokens, _, _ = serve(jm, [Request(i, p, 4) for i, p in enumerate(prompts)], max_batch=2,
                         policy="continuous", cache="paged", num_blocks=4, block_len=4)
    assert [tokens[i] for i in range(2)] == want
    mqa = cfg.replace(n_kv_head=1)  # grouped attention's cached path (bucketed reads) on JAX
    assert generate(GPT(mqa, backend="jax"), prompts, 4) == generate(GPT(mqa), prompts, 4)


sampling = st.builds(SamplingParams, temperature=st.sampled_from([0.0, 0.7, 1.0, 1.5]),
                     top_k=st.sampled_from([None, 1, 5]), top_p=st.sampled_from([None, 0.5, 0.9]),
                     seed=st.integers(0, 5))


@given(prompts=st.lists(st.lists(st.integers(0, V - 1), min_size=1, max_size=12), min_size=2, max_size=4),
       new=st.integers(1, 10), params=sampling, stop=st.sets(st.integers(0, V - 1), max_size=3))
def test_batched_equals_one_at_a_time(prompts, new, params, stop):
    batched = generate(model(), prompts, new, params, stop_tokens=stop)
    alone = [generate(model(), [p], new, params, stop_tokens=stop, ids=[i])[0] for i, p in enumerate(prompts)]
    assert batched == alone
    for out in batched:
        assert 1 <= len(out) <= new
        assert all(t not in stop for t in out[:-1])
        assert len(out) == new or out[-1] in stop


def test_stop_token_ends_a_sequence():
    free = generate(model(), [[1, 2, 3]], 10)[0]
    stop = free[3]
    out = generate(model(), [[1, 2, 3]], 10, stop_tokens=[stop])[0]
    assert out == free[:free.index(stop) + 1]


def test_sampling_is_seeded_and_follows_the_distribution():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    p = SamplingParams(temperature=1.0, seed=7)
    from minidist.infer import sample

    rng = p.generator(0)
    draws = np.array([sample(logits[None], p, [rng])[0] for _ in range(3000)])
    freq = np.bincount(draws, minlength=4) / draws.size
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.03)
    again = [sample(logits[None], p, [p.generator(0)])[0] for _ in range(5)]
    assert len(set(again)) == 1  # same seed, same stream: same draw


def test_filters():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    np.testing.assert_allclose(filter_probs(logits, SamplingParams(1.0, top_k=2)), [4 / 7, 3 / 7, 0, 0])
    np.testing.assert_allclose(filter_probs(logits, SamplingParams(1.0, top_p=0.65)), [4 / 7, 3 / 7, 0, 0])
    np.testing.assert_allclose(filter_probs(logits, SamplingParams(1.0, top_p=0.4)), [1, 0, 0, 0])
    hot = filter_probs(logits, SamplingParams(2.0))
    assert hot[0] < 0.4 and hot[3] > 0.1  # temperature > 1 flattens
    assert generate(model(), [[1, 2]], 5, SamplingParams(1.0, top_k=1)) == generate(model(), [[1, 2]], 5)


def test_clear_errors():
    with pytest.raises(ValueError, match="empty"):
        generate(model(), [[1, 2], []], 3)
    with pytest.raises(ValueError, match="longer than the context"):
        generate(model(), [list(range(BLOCK + 1))], 1)
    with pytest.raises(ValueError, match="block_size 40"):
        generate(model(), [[1] * 30], 20)
    with pytest.raises(ValueError, match=r"no prompts: pass a list of at least one prompt"):
        generate(model(), [], 3)
    with pytest.raises(ValueError, match=r"prompt 1 has token id 32 at position 2 .* \[0, 32\)"):
        generate(model(), [[1], [0, 5, V, 7]], 2)
    with pytest.raises(ValueError, match=r"prompt 0 has token id -1 at position 0"):
        generate(model(), [[-1]], 2)
    with pytest.raises(ValueError, match=r"prompt 0 has token id 99"):
        generate_recompute(model(), [[99]], 2)
    with pytest.raises(ValueError, match=r"prompt 0 must hold integer token ids, got dtype float64"):
        generate(model(), [[1.5, 2.0]], 2)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
