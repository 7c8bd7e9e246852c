"""Prefix caching: shared blocks give the same tokens as no sharing; counts, eviction and collisions."""

from functools import cache

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist.infer import Decoder, OutOfBlocks, PagedKVCache, generate
from minidist.infer.prefix_cache import PrefixCachingKVCache
from minidist.infer.prefix_generate import generate_with_prefix_cache
from minidist.nn import GPT, GPTConfig
from tests.conftest import budget

V, BLOCK = 13, 40


@cache
def model(n_kv_head=None):
    return GPT(GPTConfig(vocab_size=V, block_size=BLOCK, n_layer=2, n_head=4, d_model=16, dtype="float64",
                         seed=4, n_kv_head=n_kv_head))


def tiny_hash(parent, tokens):
    """Two values in all: almost every pair of blocks collides."""
    return (parent + sum(tokens)) % 2


def check_pool(c: PrefixCachingKVCache):
    """Every block is exactly one of: free, cached with no user, used by slots (refs = table entries)."""
    used = np.zeros(c.num_blocks, dtype=np.int64)
    for s in range(c.n_slots):
        for b in c.tables[s, :c.n_blocks[s]]:
            used[b] += 1
    np.testing.assert_array_equal(c.refs, used)
    free, idle = set(c.free), set(c.idle)
    assert len(free) == len(c.free) and not free & idle
    assert not (free | idle) & set(np.nonzero(used)[0])
    assert len(free) + len(idle) + int((used > 0).sum()) == c.num_blocks
    assert idle <= set(c.prefix_of) and not free & set(c.prefix_of)


requests = st.lists(st.tuples(st.integers(0, 14), st.lists(st.integers(0, V - 1), min_size=0, max_size=6)),
                    min_size=1, max_size=3)


@budget(40)
@given(system=st.lists(st.integers(0, V - 1), min_size=0, max_size=14),
       batches=st.lists(requests, min_size=1, max_size=3), new=st.integers(1, 5),
       block_len=st.sampled_from([2, 3, 4]), tiny=st.booleans(), kv=st.sampled_from([None, 1]),
       spare=st.integers(0, 6))
def test_outputs_are_token_identical_with_and_without_prefix_caching(system, batches, new, block_len, tiny,
                                                                     kv, spare):
    """Batches of requests: a cut of one system prompt (shared, partially shared, not at all) plus
    their own tokens. Every batch through one prefix cache (a small pool: evictions) gives the tokens
    and logits of plain ``generate`` and of a paged cache without sharing."""
    m = model(kv)
    dec = Decoder.from_model(m)
    most = max(len(b) for b in batches)
    batches = [[system[:cut] + own or [0] for cut, own in batch] for batch in batches]
    need = max(sum(-(-(len(p) + new) // block_len) for p in prompts) for prompts in batches)  # a tight pool
    shared = PrefixCachingKVCache.for_decoder(dec, most, num_blocks=need + spare, block_len=block_len,
                                              hash_fn=tiny_hash if tiny else None)
    plain = PagedKVCache.for_decoder(dec, most, num_blocks=need, block_len=block_len)
    for prompts in batches:
        got, lg = generate_with_prefix_cache(m, prompts, new, shared, return_logits=True)
        ref, lr = generate(m, prompts, new, return_logits=True)
        assert got == ref
        assert generate_with_prefix_cache(m, prompts, new, plain) == ref
        for a, b in zip(lg, lr):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-11)
        check_pool(shared)
    s = shared.stats()
    assert s["hit_tokens"] == s["prefill_tokens_saved"] <= s["looked_up_tokens"]


def small(block_len=4, num_blocks=8, n_slots=2, hash_fn=None):
    return PrefixCachingKVCache.for_decoder(Decoder.from_model(model()), n_slots, num_blocks=num_blocks,
                                            block_len=block_len, hash_fn=hash_fn)


def run(c, prompt, new=1):
    return generate_with_prefix_cache(model(), [prompt], new, c)[0]


def test_hits_count_whole_blocks_and_leave_the_last_prompt_token_to_compute():
    c = small()
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    run(c, a, new=1)  # holds 10 tokens: blocks [1..4], [5..8] full and cached; [9, 10] not
    assert c.stats()["cached_blocks"] == 2
    assert c.match(0, a[:9] + [12]) == 8  # shares 9 tokens: both full blocks
    c.release(0)
    assert c.match(0, a[:8]) == 4  # 8 tokens, all cached: the last block recomputed (its last token)
    c.release(0)
    assert c.match(0, [1, 2, 3, 5, 6]) == 0  # differs inside the first block
    c.release(0)
    s = c.stats()
    assert (s["looked_up_tokens"], s["hit_tokens"]) == (10 + 10 + 8 + 5, 12)
    assert s["hit_rate"] == pytest.approx(12 / 33)


def test_colliding_hashes_never_share_a_block_of_another_prefix():
    """Every hash equal: a block is still shared only when its whole token prefix is the same."""
    c = small(hash_fn=lambda parent, tokens: 0)
    run(c, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert c.match(0, [9, 9, 9, 9, 5, 6, 7, 8, 0]) == 0  # same 2nd block's tokens, other prefix
    c.release(0)
    assert c.match(0, [1, 2, 3, 4, 9, 9, 9, 9, 0]) == 4
    c.release(0)
    assert c.match(0, [1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8
    c.release(0)


def test_blocks_in_use_are_never_evicted_and_idle_ones_go_least_recently_used_first():
    c = small(block_len=2, num_blocks=5)
    a, b = [1, 2, 3, 4, 0], [5, 6, 7, 8, 0]
    run(c, a)  # holds 5 tokens: (1,2) (3,4) cached, the partial block (0) back to the free list
    run(c, b)  # (5,6) (7,8) cached; released last-block-first: idle = (3,4) (1,2) (7,8) (5,6)
    assert c.stats()["evictions"] == 0 and len(c.idle) == 4 and len(c.free) == 1
    c.reserve(0, 4)  # 2 blocks: the free one, then the least recently used idle one: (3,4)
    assert c.stats()["evictions"] == 1
    c.release(0)
    assert c.match(1, a) == 2 and c.match(0, b) == 4  # a kept (1,2) only; b is whole
    c.release(1)
    check_pool(c)
    held = {int(x) for x in c.tables[0, :2]}
    c.reserve(1, 6)  # 3 blocks: 2 free + (1,2), idle; b's blocks are in use by slot 0
    assert c.stats()["evictions"] == 2 and not held & {int(x) for x in c.tables[1, :3]}
    with pytest.raises(OutOfBlocks):
        c.reserve(1, 8)  # only slot 0's blocks are left: never evicted while in use
    check_pool(c)
    c.release(1)
    assert c.match(1, b) == 4  # still cached, now shared by two slots
    assert c.refs[c.tables[1, 0]] == 2 and c.refs[c.tables[1, 1]] == 2
    check_pool(c)


def test_time_to_first_token_is_recorded_per_prompt_in_order():
    ttft = []
    c = small(n_slots=3, num_blocks=12)
    generate_with_prefix_cache(model(), [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [7]], 2, c, ttft=ttft)
    assert len(ttft) == 3 and 0 < ttft[0] <= ttft[1] <= ttft[2]


def test_clear_errors():
    c = small()
    c.reserve(0, 3)
    with pytest.raises(ValueError, match="match.*empty slot"):
        c.match(0, [1, 2, 3])
    with pytest.raises(ValueError, match="slots \\[0\\] of the cache are in use"):
        generate_with_prefix_cache(model(), [[1, 2]], 1, c)
    with pytest.raises(ValueError, match="at most 2 per call"):
        generate_with_prefix_cache(model(), [[1], [2], [3]], 1, small())
