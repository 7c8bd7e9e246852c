"""Continuous batching == static batching == one at a time; paged cache == contiguous cache."""

from functools import cache

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist.autograd.tensor import no_grad
from minidist.infer import (
    GREEDY,
    Decoder,
    KVCache,
    OutOfBlocks,
    PagedKVCache,
    Request,
    SamplingParams,
    forward_tokens,
    generate,
    serve,
)
from minidist.nn import GPT, GPTConfig
from tests.conftest import budget

V, BLOCK = 32, 48


@cache
def model():
    return GPT(GPTConfig(vocab_size=V, block_size=BLOCK, n_layer=2, n_head=2, d_model=32, seed=2))


requests = st.lists(
    st.builds(lambda p, n, a: (p, n, a), st.lists(st.integers(0, V - 1), min_size=1, max_size=10),
              st.integers(0, 16), st.integers(0, 8)),
    min_size=1, max_size=8)


def make(reqs, sampling=GREEDY):
    return [Request(i, p, n, sampling, arrival=a) for i, (p, n, a) in enumerate(reqs)]


@given(reqs=requests, max_batch=st.integers(1, 4), temperature=st.sampled_from([0.0, 1.0]),
       stop=st.sets(st.integers(0, V - 1), max_size=3))
def test_continuous_equals_static_and_one_at_a_time(reqs, max_batch, temperature, stop):
    sp = SamplingParams(temperature=temperature, top_k=8, seed=3)
    rs = make(reqs, sp)
    for r in rs:
        r.stop_tokens = tuple(stop)
    cont, st_c, done = serve(model(), rs, max_batch=max_batch)
    stat, st_s, _ = serve(model(), rs, max_batch=max_batch, policy="static")
    alone = {r.id: (generate(model(), [r.prompt], r.max_new_tokens, sp, stop, ids=[r.id])[0]
                    if r.max_new_tokens else []) for r in rs}
    assert cont == stat == alone
    assert st_c["tokens"] == st_s["tokens"] == sum(len(t) for t in alone.values())
    assert st_c["steps"] <= st_s["steps"]  # never slower, in steps
    for r in done:  # a request starts only after it arrives, and runs to its length
        assert r.admitted is None or r.admitted >= r.arrival


@given(reqs=requests, max_batch=st.integers(1, 4), block_len=st.sampled_from([2, 4, 16]),
       spare=st.integers(0, 6))
def test_paged_equals_contiguous_with_preemption(reqs, max_batch, block_len, spare):
    """A pool just big enough for the longest request forces preemptions + recompute; same tokens."""
    rs = make(reqs)
    need = max(-(-(len(r.prompt) + r.max_new_tokens) // block_len) for r in rs)
    contiguous, _, _ = serve(model(), rs, max_batch=max_batch)
    paged, stats, _ = serve(model(), rs, max_batch=max_batch, cache="paged", num_blocks=need + spare,
                            block_len=block_len)
    assert paged == contiguous
    assert stats["peak_reserved"] <= (need + spare) * block_len * 2 * 2 * 32 * 4


@given(lens=st.lists(st.integers(1, 30), min_size=1, max_size=4), block_len=st.sampled_from([1, 3, 16]))
def test_paged_logits_bit_equal_and_accounting(lens, block_len):
    w = Decoder.from_model(model())
    rng = np.random.default_rng(sum(lens))
    seqs = [list(rng.integers(0, V, n)) for n in lens]
    contiguous = KVCache.for_decoder(w, len(seqs))
    paged = PagedKVCache.for_decoder(w, len(seqs), num_blocks=sum(-(-n // block_len) for n in lens),
                                     block_len=block_len)
    slots = list(range(len(seqs)))
    with no_grad():
        for cut in (slice(0, 1), slice(1, None)):  # a one-token prefill, then the rest
            rows = [i for i in slots if seqs[i][cut]]
            if not rows:
                continue
            feed = [seqs[i][cut] for i in rows]
            for i, f in zip(rows, feed):
                paged.reserve(i, int(paged.lengths[i]) + len(f))
            a = forward_tokens(w, contiguous, rows, feed)
            b = forward_tokens(w, paged, rows, feed)
            for r, f in enumerate(feed):  # real positions only (the rest is padding)
                np.testing.assert_array_equal(a[r, :len(f)], b[r, :len(f)])
    mem = paged.memory()
    per_tok = 2 * 2 * 32 * 4  # k and v, 2 layers, d 32, float32
    assert mem["used"] == sum(lens) * per_tok
    assert 0 <= mem["waste"] < len(lens) * block_len * per_tok  # < one block per sequence
    assert mem["free_blocks"] == 0
    with pytest.raises(OutOfBlocks):
        paged.reserve(0, lens[0] + block_len)
    for s in slots:
        paged.release(s)
    assert sorted(paged.free) == list(range(paged.num_blocks))


def test_continuous_batching_short_requests_finish_early():
    """One long request and many short ones: continuous batching finishes the short ones sooner."""
    rs = [Request(0, [1, 2, 3], 40)] + [Request(i, [i], 3) for i in range(1, 7)]
    _, sc, dc = serve(model(), rs, max_batch=2)
    _, ss, ds = serve(model(), rs, max_batch=2, policy="static")
    mean = lambda done: np.mean([r.finished - r.arrival for r in done if r.id])  # noqa: E731
    assert mean(dc) < mean(ds)
    assert sc["steps"] < ss["steps"]


def test_scheduler_errors():
    with pytest.raises(ValueError, match="empty"):
        serve(model(), [Request(0, [], 3)])
    with pytest.raises(ValueError, match="longer than the context"):
        serve(model(), [Request(0, [1] * (BLOCK + 1), 1)])
    with pytest.raises(ValueError, match=r"request 3 has token id -2 at position 1"):
        serve(model(), [Request(3, [1, -2], 1)])
    with pytest.raises(ValueError, match="can never fit"):
        serve(model(), [Request(0, [1] * 10, 10)], cache="paged", num_blocks=1, block_len=16)
    with pytest.raises(ValueError, match="policy"):
        serve(model(), [Request(0, [1], 1)], policy="fifo")


def test_preemption_and_recompute_happen_and_agree():
    rs = [Request(i, [i + 1, 2, 3, 4], 20) for i in range(4)]
    contiguous, _, _ = serve(model(), rs, max_batch=4)
    paged, stats, done = serve(model(), rs, max_batch=4, cache="paged", num_blocks=9, block_len=4)
    assert stats["preemptions"] > 0 and any(r.preemptions for r in done)
    assert paged == contiguous


@cache
def model64(n_kv_head=None):
    """float64: a prefill that starts after a cached prefix sums in another order; 64 bits keep
    greedy ties and sampling boundaries out of reach of that rounding."""
    return GPT(GPTConfig(vocab_size=V, block_size=BLOCK, n_layer=2, n_head=4, d_model=16, dtype="float64",
                         seed=5, n_kv_head=n_kv_head))


shared_requests = st.lists(st.tuples(st.integers(0, 12), st.lists(st.integers(0, V - 1), max_size=5),
                                     st.integers(1, 8), st.integers(0, 6)), min_size=1, max_size=7)


@budget(30)
@given(system=st.lists(st.integers(0, V - 1), max_size=12), reqs=shared_requests, max_batch=st.integers(1, 3),
       block_len=st.sampled_from([2, 3, 4]), spare=st.integers(0, 8), temperature=st.sampled_from([0.0, 1.0]),
       kv=st.sampled_from([None, 2, 1]))
def test_prefix_caching_serves_the_same_tokens(system, reqs, max_batch, block_len, spare, temperature, kv):
    """Requests whose prompts are a cut of one system prompt (all of it shared, part of it, none)
    plus their own tokens, arriving over time: the scheduler over a prefix-caching pool (small
    enough to evict and preempt) gives the tokens of the contiguous cache and of a paged one
    without sharing; its counts agree with the cache's and the hits are whole blocks."""
    sp = SamplingParams(temperature=temperature, top_k=8, seed=1)
    rs = [Request(i, system[:cut] + own or [0], n, sp, arrival=a) for i, (cut, own, n, a) in enumerate(reqs)]
    need = max(-(-(len(r.prompt) + r.max_new_tokens) // block_len) for r in rs)
    kw = dict(max_batch=max_batch, cache="paged", num_blocks=need + spare, block_len=block_len)
    contiguous, _, _ = serve(model64(kv), rs, max_batch=max_batch)
    paged, _, _ = serve(model64(kv), rs, **kw)
    shared, stats, done = serve(model64(kv), rs, prefix_cache=True, **kw)
    assert shared == paged == contiguous
    assert stats["hit_tokens"] % block_len == 0 and 0 <= stats["hit_tokens"] <= stats["looked_up_tokens"]
    assert stats["looked_up_tokens"] >= sum(len(r.prompt) for r in rs)  # re-admissions look up again
    assert all(r.ttft_s is not None for r in done)


def test_prefix_caching_hits_a_shared_system_prompt():
    """Eight requests, one at a time, with a 20-token system prompt and blocks of 4: the first
    computes it, each later one finds its 5 full blocks (20 tokens; its own 3 and its first new
    token fill a block of its own) -- 7 * 20 of 8 * 23 prompt tokens."""
    system = list(range(1, 21))
    rs = [Request(i, system + [i, i + 1, i + 2], 4) for i in range(8)]
    plain, _, _ = serve(model64(), rs, max_batch=1, cache="paged", block_len=4)
    shared, stats, _ = serve(model64(), rs, max_batch=1, prefix_cache=True, block_len=4)
    assert shared == plain
    assert stats["hit_tokens"] == stats["prefill_tokens_saved"] == 7 * 20
    assert stats["looked_up_tokens"] == 8 * 23
    assert stats["hit_rate"] == pytest.approx(7 * 20 / (8 * 23))
    assert stats["forward_rows"] == 8 * 23 - 7 * 20 + 8 * 3  # prefills without the hits + decodes


def test_scheduler_prefix_cache_errors():
    from minidist.infer.prefix_cache import PrefixCachingKVCache

    r = [Request(0, [1], 1)]
    with pytest.raises(ValueError, match="prefix_cache=True shares paged blocks"):
        serve(model(), r, cache="contiguous", prefix_cache=True)
    with pytest.raises(ValueError, match="prefix_cache must be True or False"):
        serve(model(), r, prefix_cache="yes")
    small = PrefixCachingKVCache.for_decoder(Decoder.from_model(model()), 1, 8, 4)
    with pytest.raises(ValueError, match="1 slots for max_batch 2"):
        serve(model(), r, max_batch=2, cache=small)
    with pytest.raises(ValueError, match="pass a PrefixCachingKVCache"):
        serve(model(), r, max_batch=1, prefix_cache=True,
              cache=PagedKVCache.for_decoder(Decoder.from_model(model()), 1, 8, 4))
    with pytest.raises(ValueError, match="cache must be"):
        serve(model(), r, cache="radix")
    out, _, _ = serve(model(), r, max_batch=1, cache=small)  # a cache object is served over
    assert out == {0: generate(model(), [[1]], 1)[0]}


@pytest.mark.parametrize("argv, words", [
    (["--heads", "4", "--kv-heads", "3"], ["--kv-heads", "divide --heads 4"]),
    (["--kv-dtype", "int4"], ["--kv-dtype", "int8"])])
def test_the_inference_lessons_kv_flags_are_checked_before_ranks_start(argv, words, monkeypatch, capsys):
    from minidist.lessons import inference

    monkeypatch.setattr(inference, "launch", lambda *a: pytest.fail("launched with a bad flag"))
    with pytest.raises(SystemExit) as info:
        inference.main(argv)
    assert info.value.code == 2
    line = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()][-1]
    assert "error:" in line and all(w in line for w in words), line


def test_the_inference_lesson_fails_when_int8_bytes_miss_the_formula(monkeypatch, capsys):
    """The lesson's int8 check is real: a formula off by one byte per token exits 1 with FAIL."""
    from minidist.lessons import inference, inference_prefix

    monkeypatch.setattr(inference_prefix, "int8_bytes_per_token", lambda *a: 1)
    with pytest.raises(SystemExit) as info:
        inference.main("--ranks 1 --steps 1 --speculative 0 --kv-dtype int8 --kv-heads 2".split())
    out = capsys.readouterr().out
    assert info.value.code == 1 and "FAIL" in out and "3b. prefix caching" in out
