"""The int8 KV cache: the quantizer's error bound, bytes per token from the arrays = the formula,
the logit error against the float32 cache bounded, greedy tokens identical on a trained model."""

from functools import cache

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist.infer import Decoder, KVCache, PagedKVCache, forward_tokens, generate
from minidist.infer.prefix_generate import generate_with_prefix_cache
from minidist.infer.quant_kv import (
    Int8KVCache,
    Int8PagedKVCache,
    Int8PrefixCachingKVCache,
    dequantize,
    int8_bytes_per_token,
    quantize,
)
from minidist.nn import GPT, GPTConfig
from tests.conftest import budget


@budget(50)
@given(st.integers(1, 4), st.integers(1, 9), st.floats(1e-3, 1e3), st.integers(0, 999))
def test_quantizer_error_is_at_most_half_a_step_of_each_vector(n, d, scale, seed):
    """|x̂ - x| <= max|x| / 254 for every vector (one token, one head), values in [-127, 127]."""
    x = (np.random.default_rng(seed).standard_normal((2, n, 3, d)) * scale).astype(np.float32)
    x[0, 0, 0] = 0.0  # an all-zero vector comes back as zeros
    q, s = quantize(x)
    assert q.dtype == np.int8 and s.shape == (2, n, 3, 1) and np.abs(q.astype(int)).max() <= 127
    back = dequantize(q, s, np.float32)
    bound = np.abs(x).max(axis=-1, keepdims=True) / 254
    assert np.all(np.abs(back - x) <= bound * (1 + 1e-5) + 1e-30)
    assert np.all(back[0, 0, 0] == 0)
    assert np.all(np.abs(q).max(axis=-1) == np.where(np.abs(x).max(axis=-1) > 0, 127, 0))  # full range


def tiny(n_kv_head=None):
    return GPT(GPTConfig(vocab_size=32, block_size=64, n_layer=2, n_head=4, d_model=32, seed=1,
                         n_kv_head=n_kv_head))


@pytest.mark.parametrize("n_kv", [None, 2, 1])
def test_bytes_per_token_measured_from_the_arrays_equal_the_formula(n_kv):
    dec = Decoder.from_model(tiny(n_kv))
    k = n_kv or 4
    want = 2 * 2 * k * (8 * 1 + 4)  # 2 (k, v) · layers · K/V heads · (8 int8 + a float32 scale)
    assert int8_bytes_per_token(2, k, 8) == want
    for c in (Int8KVCache.for_decoder(dec, 3),
              Int8PagedKVCache.for_decoder(dec, 3, num_blocks=5, block_len=4)):
        positions = c.k[0].shape[0] * c.k[0].shape[2]
        measured = sum(a.nbytes for a in [*c.k, *c.v, *c.k_scale, *c.v_scale]) / positions
        assert measured == c.bytes_per_token() == want
        assert c.k[0].dtype == np.int8 and c.k_scale[0].dtype == np.float32
    fp32 = KVCache.for_decoder(dec, 3).bytes_per_token()
    assert fp32 == 2 * 2 * k * 8 * 4 and want / fp32 == pytest.approx(12 / 32)


@pytest.mark.parametrize("n_kv", [None, 1])
def test_logit_error_against_the_float32_cache_is_bounded(n_kv):
    """Prefill 3 prompts of 40 tokens, then 8 decode steps: every logit within 1% of the logits'
    largest magnitude of the float32 cache's (measured: ~1e-3 of it on this model)."""
    m = tiny(n_kv)
    dec = Decoder.from_model(m)
    rng = np.random.default_rng(0)
    seqs = [[int(t) for t in rng.integers(0, 32, 48)] for _ in range(3)]
    ref, q8, q8p = KVCache.for_decoder(dec, 3), Int8KVCache.for_decoder(dec, 3), \
        Int8PagedKVCache.for_decoder(dec, 3, num_blocks=3 * 12, block_len=4)
    for s in range(3):
        q8p.reserve(s, 48)
    outs = {id(c): [] for c in (ref, q8, q8p)}
    for lo, hi in [(0, 40)] + [(t, t + 1) for t in range(40, 48)]:
        for c in (ref, q8, q8p):
            outs[id(c)].append(forward_tokens(dec, c, [0, 1, 2], [s[lo:hi] for s in seqs]))
    a, b, p = (np.concatenate(outs[id(c)], axis=1) for c in (ref, q8, q8p))
    err = np.abs(a - b).max()
    assert 0 < err <= 0.01 * np.abs(a).max(), (err, np.abs(a).max())
    np.testing.assert_allclose(p, b, rtol=1e-5, atol=1e-6)  # paged and contiguous: the same int8 values


@cache
def trained():
    """A small GPT trained for 60 steps on the lesson's text (a second or two)."""
    from minidist.lessons.train import train
    from minidist.nn.data import BatchLoader, ByteTokenizer, TextDataset

    tok = ByteTokenizer()
    m = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=48, n_layer=2, n_head=4, d_model=32, seed=0))
    train(m, BatchLoader(TextDataset.from_file(None, block_size=48), 16, seed=0), 60, 3e-3, log=False)
    m.eval()
    prompts = ["Data parallelism ", "The pipeline ", "A neural network ", "Each rank ", "The gradient ",
               "Tensor parallel", "Memory ", "We ", "The model ", "A ring all-reduce "]
    return m, [[int(t) for t in tok.encode(p)] for p in prompts]


def test_greedy_tokens_with_the_int8_cache_equal_the_float32_ones_on_a_trained_model():
    m, prompts = trained()
    dec = Decoder.from_model(m)
    want = generate(m, prompts, 20)
    c = Int8PagedKVCache.for_decoder(dec, len(prompts), num_blocks=len(prompts) * 6, block_len=8)
    assert generate_with_prefix_cache(m, prompts, 20, c) == want
    shared = Int8PrefixCachingKVCache.for_decoder(dec, len(prompts), num_blocks=len(prompts) * 6, block_len=4)
    plain = PagedKVCache.for_decoder(dec, len(prompts), num_blocks=len(prompts) * 12, block_len=4)
    system = [int(t) for t in b"You are a helpful model. "]
    asked = [system + p[:12] for p in prompts]
    for _ in range(2):  # the second round hits the first one's int8 blocks
        want = generate_with_prefix_cache(m, asked, 6, plain)
        assert generate_with_prefix_cache(m, asked, 6, shared) == want
    assert shared.stats()["hit_tokens"] >= 19 * 24  # the system prompt's 6 whole blocks, all but once


def test_int8_and_prefix_caches_on_jax():
    """JAX's immutable arrays: values and scales written with set_at, read bucketed; same tokens as
    NumPy's int8 cache."""
    pytest.importorskip("jax")
    cfg = GPTConfig(vocab_size=32, block_size=32, n_layer=1, n_head=2, d_model=16, seed=2, n_kv_head=1)
    prompts = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7]]
    outs = []
    for backend in ("numpy", "jax"):
        m = GPT(cfg, backend=backend)
        c = Int8PrefixCachingKVCache.for_decoder(Decoder.from_model(m), 2, num_blocks=8, block_len=2)
        outs.append([generate_with_prefix_cache(m, prompts, 4, c) for _ in range(2)])
        assert c.stats()["hit_tokens"] > 0
    assert outs[0] == outs[1]


def test_the_lessons_quantizer_error_by_hand():
    """[127, 63.5, 0.5]: scale 1, stored [127, 64, 0] (63.5 rounds to even), errors [0, 0.5, 0.5]:
    the worst is 0.5 / 127 = 1/254, the bound itself; a zero vector's error is 0."""
    from minidist.lessons.inference_prefix import quantizer_error

    x = np.array([[[127.0, 63.5, 0.5], [0.0, 0.0, 0.0]]], np.float32)
    assert quantizer_error([x]) == pytest.approx(1 / 254)
    assert quantizer_error([x[:, 1:]]) == 0.0


def _int8_section(monkeypatch, capsys, bits=8):
    """Lesson 9's section 3c with --kv-dtype int8 on a small trained model; ``bits`` < 8 plants a
    coarser quantizer (scale max/(2^(bits-1) - 1)) in the cache and the lesson alike."""
    from minidist.infer import Request, quant_kv, serve
    from minidist.lessons import inference_prefix
    from minidist.lessons.inference_kv import PROMPTS, enc

    if bits < 8:
        top = 2 ** (bits - 1) - 1

        def coarse(x):
            scale = (np.abs(x).max(axis=-1, keepdims=True) / top).astype(np.float32)
            safe = np.where(scale > 0, scale, 1)
            return np.clip(np.rint(x / safe), -top, top).astype(np.int8), scale
        monkeypatch.setattr(quant_kv, "quantize", coarse)
        monkeypatch.setattr(inference_prefix, "quantize", coarse)
    model = trained()[0]
    args = type("Args", (), dict(layers=2, heads=4, kv_heads=4, d_model=32, kv_dtype="int8", batch=2))
    reqs = [Request(i, enc(PROMPTS[i])[:6], 4) for i in range(3)]
    out, _, _ = serve(model, reqs, max_batch=2)
    ok = inference_prefix.kv_memory(model, args, reqs, out)
    return ok, capsys.readouterr().out


def test_the_lesson_prints_int8s_accuracy_against_the_chapters_bounds(monkeypatch, capsys):
    """``--kv-dtype int8`` prints the accuracy chapter 9 claims, not only bytes: every cached vector
    within 1/254 of its largest value, the logits within 1% of the largest; a 6-bit quantizer
    planted in the cache breaks the first (1/62 per vector) and the section says FAIL."""
    import re

    ok, text = _int8_section(monkeypatch, capsys)
    assert ok and "measured == formula: PASS" in text
    ratio = float(re.search(r"max \|x̂ - x\| / max \|x\| = 1/([\d.]+) <= 1/254", text).group(1))
    assert ratio >= 254 * (1 - 1e-5)
    share = re.search(r"max \|logits diff\| .* = ([\d.]+)% of max \|logit\| \(bound 1%", text).group(1)
    assert 0 < float(share) <= 1.0
    ok, text = _int8_section(monkeypatch, capsys, bits=6)
    assert not ok and "measured == formula: FAIL" in text
