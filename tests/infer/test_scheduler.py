"""The scheduler's own numbers (``minidist.infer.scheduler``) against runs worked out by hand: which
sequence a full pool preempts, when an arrival is admitted, a request that exactly fits the cache,
and the stats it reports (rows fed, tokens, peak bytes reserved and used, steps)."""

from functools import cache

import pytest

from minidist.infer import Request, generate, serve
from minidist.infer.generate import check_prompt
from minidist.nn import GPT, GPTConfig

V, BLOCK = 32, 48
PER_TOKEN = 2 * 1 * 2 * 8 * 4  # bytes a cached token costs: (k, v) x 1 layer x 2 heads x head_dim 8 x float32


@cache
def model():
    return GPT(GPTConfig(vocab_size=V, block_size=BLOCK, n_layer=1, n_head=2, d_model=16, seed=2))


def _three_on_four_blocks():
    """Three 4-token prompts, 3 new tokens each, max_batch 3, a pool of 4 blocks of 4 tokens.

    step 0: all three admitted (one block each, 1 free); 12 prompt rows fed; each gets token 1.
    step 1: each needs a 2nd block. Slot 0 takes the free one; slot 1 finds none and preempts the
            NEWEST other sequence, request 2 (slot 2), whose block it then takes. 2 rows fed.
    step 2: request 2 waits (5 tokens = 2 blocks, none free); requests 0, 1 get token 3 and finish.
    step 3: request 2 readmitted, its prompt and its 1 token (5 rows) fed again: token 2.
    step 4: its token 3; done. 5 steps, 3 + 2 + 2 + 1 + 1 = 9 tokens, 12 + 2 + 2 + 5 + 1 = 22 rows.
    Bytes before each pass: reserved 12, 16, 16, 8, 8 tokens; used 0, 8, 10, 0, 5 tokens."""
    reqs = [Request(i, [1 + i, 2, 3, 4], 3) for i in range(3)]
    return serve(model(), reqs, max_batch=3, cache="paged", num_blocks=4, block_len=4)


def test_a_full_pool_preempts_the_newest_other_sequence_and_recomputes_it():
    out, stats, done = _three_on_four_blocks()
    assert [r.preemptions for r in done] == [0, 0, 1]
    assert stats["preemptions"] == 1
    assert [(r.admitted, r.finished) for r in done] == [(0, 2), (0, 2), (0, 4)]  # admitted: the first time
    assert stats["history"] == [{0: 0, 1: 1, 2: 2}, {0: 0, 1: 1}, {0: 0, 1: 1}, {0: 2}, {0: 2}]
    assert out == {i: generate(model(), [[1 + i, 2, 3, 4]], 3)[0] for i in range(3)}


def test_the_stats_of_a_run_with_a_preemption_by_hand():
    _, stats, _ = _three_on_four_blocks()
    assert (stats["steps"], stats["tokens"], stats["forward_rows"]) == (5, 9, 22)
    assert stats["peak_reserved"] == 16 * PER_TOKEN
    assert stats["peak_used"] == 10 * PER_TOKEN


def test_a_request_is_admitted_at_the_step_it_arrives():
    """Request 0 (arrival 0, 1 token) is done at step 0; request 1 arrives at step 2: nothing runs at
    step 1, request 1 is admitted and finished at step 2, 3 steps in all."""
    out, stats, done = serve(model(), [Request(0, [1, 2], 1, arrival=0), Request(1, [3], 1, arrival=2)])
    assert [(r.admitted, r.finished) for r in done] == [(0, 0), (2, 2)]
    assert stats["steps"] == 3 and stats["history"] == [{0: 0}, {}, {0: 1}]


@pytest.mark.parametrize("cache_kw", [{}, {"cache": "paged", "num_blocks": 12, "block_len": 4}])
def test_a_sequence_of_exactly_the_context_is_served_and_one_more_token_is_refused(cache_kw):
    """44 prompt tokens + 4 new = 48 = block_size: served, the 4 tokens generate gives; 5 new: refused."""
    prompt = [t % V for t in range(44)]
    assert check_prompt(prompt, BLOCK, 4) == prompt
    out, _, _ = serve(model(), [Request(0, prompt, 4)], **cache_kw)
    assert out[0] == generate(model(), [prompt], 4)[0] and len(out[0]) == 4
    with pytest.raises(ValueError, match="44 tokens \\+ max_new_tokens 5 = 49 > block_size 48"):
        serve(model(), [Request(0, prompt, 5)], **cache_kw)


def test_a_request_that_exactly_fills_a_paged_pool_is_served_and_one_more_token_is_refused():
    """A pool of 2 blocks of 4 = 8 positions: 4 prompt tokens + 4 new fit exactly; + 5 never can."""
    out, _, _ = serve(model(), [Request(0, [1, 2, 3, 4], 4)], cache="paged", num_blocks=2, block_len=4)
    assert out[0] == generate(model(), [[1, 2, 3, 4]], 4)[0]
    with pytest.raises(ValueError, match="request 0: 9 tokens can never fit the cache \\(8 positions\\)"):
        serve(model(), [Request(0, [1, 2, 3, 4], 5)], cache="paged", num_blocks=2, block_len=4)
