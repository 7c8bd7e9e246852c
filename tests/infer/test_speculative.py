"""Speculative decoding: greedy == the target alone, sampled ~ the target's distribution, the cache
rolled back, batching changing nothing, and the counts behind the speed-up formula."""

import itertools
from functools import cache

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist.grading.speculative import ALPHA, chi_square_pvalue
from minidist.infer import (
    GREEDY,
    SamplingParams,
    SpecStats,
    expected_speedup,
    filter_probs,
    full_logits,
    generate,
    speculative_generate,
)
from minidist.nn import GPT, GPTConfig

V, BLOCK = 32, 48


def gpt(vocab=V, layers=2, d=32, seed=2, head_scale=1.0, noise=0.0, like=None):
    """A GPT; ``like``: start from that model's weights plus Gaussian ``noise`` (a draft that
    agrees with it often, not always); ``head_scale`` sharpens its distributions."""
    m = GPT(GPTConfig(vocab_size=vocab, block_size=BLOCK, n_layer=layers, n_head=2, d_model=d, seed=seed))
    state = {k: np.array(v) for k, v in (like or m).state_dict().items()}
    rng = np.random.default_rng(seed)
    for k in state:
        state[k] = state[k] + noise * rng.standard_normal(state[k].shape).astype(state[k].dtype)
    last = max(k for k in state if k.endswith("proj.weight") and k.count(".") == 2)
    state[last] = state[last] * np.float32(head_scale)
    m.load_state_dict(state)
    return m.eval()


@cache
def target():
    return gpt(head_scale=4.0)


@cache
def drafts():
    """A 1-layer half-width model (mostly rejected), the target plus noise (mostly accepted)."""
    return {"small": gpt(layers=1, d=16, seed=5), "noisy": gpt(seed=7, noise=0.05, like=target())}


prompts = st.lists(st.lists(st.integers(0, V - 1), min_size=1, max_size=10), min_size=1, max_size=3)


@given(ps=prompts, n=st.integers(0, 14), k=st.integers(1, 5), which=st.sampled_from(["small", "noisy"]),
       stop=st.sets(st.integers(0, V - 1), max_size=2))
def test_greedy_is_the_target_token_for_token(ps, n, k, which, stop):
    st_ = SpecStats()
    got = speculative_generate(target(), drafts()[which], ps, n, k=k, stop_tokens=stop, stats=st_)
    assert got == generate(target(), ps, n, stop_tokens=stop)
    assert st_.tokens == sum(max(len(t) - 1, 0) for t in got)  # the prefill gives each first token
    assert 0 <= st_.accepted <= st_.proposed <= k * st_.rounds


def test_a_perfect_draft_is_always_accepted_and_rounds_are_k_plus_one():
    """Draft == target (greedy): every proposal survives, so after the prefill's first token each
    round emits k + 1: ceil((n - 1) / (k + 1)) rounds, and the target runs that many times + 1."""
    n, k = 20, 3
    st_ = SpecStats()
    got = speculative_generate(target(), target(), [[1, 2, 3]], n, k=k, stats=st_)
    assert got == generate(target(), [[1, 2, 3]], n)
    assert st_.acceptance_rate == 1.0
    assert st_.rounds == -(-(n - 1) // (k + 1)) == st_.target_passes - 1
    assert st_.proposed == n - 1 - st_.rounds  # the last round proposes only what is still wanted


def test_the_caches_are_rolled_back_past_rejected_tokens():
    """A draft that is mostly wrong: nearly every round rejects, leaving stale keys in both caches
    beyond the kept length. Were they not rolled back, the next rounds would attend to them."""
    st_ = SpecStats()
    ps = [[3, 1, 4, 1, 5], [9, 2, 6]]
    got = speculative_generate(target(), drafts()["small"], ps, 24, k=4, stats=st_)
    assert got == generate(target(), ps, 24)
    assert st_.proposed - st_.accepted >= 10  # many rejections happened


def test_batched_equals_one_at_a_time_with_sampling():
    sp = SamplingParams(temperature=1.0, top_k=10, seed=4)
    ps = [[1, 2], [5, 6, 7, 8], [9]]
    batched = speculative_generate(target(), drafts()["noisy"], ps, 12, k=3, sampling=sp, ids=[10, 11, 12])
    alone = [speculative_generate(target(), drafts()["noisy"], [p], 12, k=3, sampling=sp, ids=[10 + i])[0]
             for i, p in enumerate(ps)]
    assert batched == alone


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=1.0, seed=1),
                                      SamplingParams(temperature=0.7, top_k=3, seed=2)],
                         ids=["temperature 1", "temperature 0.7, top-k 3"])
def test_sampled_output_has_the_target_distribution(sampling):
    """4000 samples of 3 new tokens over a vocabulary of 4 (64 outcomes) against the exact
    probabilities p(t1) p(t2 | t1) p(t3 | t1 t2) from the target's own forward. Chi-square at
    p < 1e-4: a correct sampler fails with probability 1e-4 over seeds; the seed is fixed."""
    vocab, n, prompt = 4, 4000, [1, 3]
    tgt = gpt(vocab=vocab, seed=11, head_scale=6.0)
    dft = gpt(vocab=vocab, layers=1, d=16, seed=12, head_scale=6.0)  # a different model: many rejections
    st_ = SpecStats()
    outs = speculative_generate(tgt, dft, [prompt] * n, 3, k=2, sampling=sampling, ids=range(n), stats=st_)
    assert 0.2 < st_.acceptance_rate < 0.9  # the draft disagrees often enough to test the residual
    exact = {}
    for seq in itertools.product(range(vocab), repeat=3):
        prob = 1.0
        for j in range(3):
            prob *= filter_probs(full_logits(tgt, prompt + list(seq[:j]))[-1], sampling)[seq[j]]
        exact[seq] = prob
    counts = {s: 0 for s in exact}
    for o in outs:
        counts[tuple(o)] += 1
    cells = sorted(exact)
    pv = chi_square_pvalue([counts[c] for c in cells], [n * exact[c] for c in cells])
    assert pv >= ALPHA, (pv, counts)


def test_chi_square_pvalue_against_known_tails():
    """df = 2: P = exp(-x/2); df = 4: exp(-x/2)(1 + x/2) -- and a 5% critical value for df = 10."""
    assert chi_square_pvalue([10, 20, 30], [20, 20, 20]) == pytest.approx(np.exp(-10 / 2))
    assert chi_square_pvalue([12, 8, 10, 10, 10], [10] * 5) == pytest.approx(np.exp(-0.4) * 1.4)
    # 11 cells of 100 expected; the statistic 18.307 is chi-square's 95th percentile for df = 10
    d = np.sqrt(18.307 * 100 / 1.1)  # d²/100 + 10 (d/10)²/100 = 18.307
    obs = [100 + d] + [100 - d / 10] * 10
    assert chi_square_pvalue(obs, [100] * 11) == pytest.approx(0.05, abs=1e-3)


def test_expected_speedup_formula():
    assert expected_speedup(0.0, 4, 0.0) == 1.0  # nothing accepted, the draft free: plain decoding
    assert expected_speedup(1.0, 4, 0.0) == 5.0  # all accepted: k + 1 tokens per target pass
    assert expected_speedup(0.5, 2, 0.0) == pytest.approx(1.75)
    assert expected_speedup(0.8, 3, 0.1) == pytest.approx((1 + 0.8 + 0.64 + 0.512) / 1.3)


def test_greedy_stats_match_the_formula_for_tokens_per_round():
    """The measured tokens per round sit beside (1 - a^(k+1)) / (1 - a) (equal in expectation when
    each proposal is accepted independently with probability a; here: within a token)."""
    st_ = SpecStats()
    speculative_generate(target(), drafts()["noisy"], [[1, 2], [3], [4, 5, 6]], 40, k=4, stats=st_)
    a = st_.acceptance_rate
    assert 0 < a < 1
    assert abs(st_.tokens_per_round - (1 - a ** 5) / (1 - a)) < 1.0


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="k .* must be an integer >= 1, got 0"):
        speculative_generate(target(), target(), [[1]], 4, k=0)
    with pytest.raises(ValueError, match="draft's vocab_size 4 differs from the target's 32"):
        speculative_generate(target(), gpt(vocab=4), [[1]], 4)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        speculative_generate(target(), target(), [[]], 4)
    assert speculative_generate(target(), target(), [[1, 2]], 0) == [[]]
    assert GREEDY.temperature == 0.0


def test_early_exit_draft_is_the_targets_first_layers_and_head():
    """The draft's forward is the target's embedding, its first block and its head, run by hand."""
    from minidist.autograd.tensor import no_grad
    from minidist.infer import early_exit_draft

    tokens = np.array([[3, 1, 4, 1, 5]])
    embed, first, *_, head = list(target())
    with no_grad():
        want = head(first(embed(tokens))).data
    np.testing.assert_array_equal(full_logits(early_exit_draft(target(), 1), tokens[0]), want[0])
    np.testing.assert_array_equal(full_logits(early_exit_draft(target(), 2), tokens[0]),
                                  full_logits(target(), tokens[0]))
    with pytest.raises(ValueError, match=r"n_layer must be an integer in 1..2 \(the target.s layers\)"):
        early_exit_draft(target(), 3)


def test_acceptance_rate_counts_only_the_proposals_judged():
    """Two rounds of k = 4: the first keeps 3 and rejects its 4th, the second keeps all 4: 8 judged,
    7 kept, a = 7/8. Three rounds offering 12 that keep 5 with 2 rejections judged 7: a = 5/7 (5/12
    would count the proposals after a rejection, which are never judged)."""
    assert SpecStats(rounds=2, proposed=8, accepted=7, rejected=1).acceptance_rate == 7 / 8
    assert SpecStats(rounds=2, proposed=8, accepted=0, rejected=2).acceptance_rate == 0.0
    assert SpecStats(rounds=3, proposed=12, accepted=5, rejected=2).acceptance_rate == 5 / 7  # not 5/12
    assert SpecStats().acceptance_rate == 0.0


def test_a_run_counts_one_rejection_per_round_that_ends_early():
    """Whatever the draft: each round either keeps all its proposals or ends at one rejection, so
    accepted + rejected proposals judged never exceed those offered, and the tokens are accepted +
    one per round."""
    st_ = SpecStats()
    speculative_generate(target(), drafts()["noisy"], [[1, 2], [3], [4, 5, 6]], 30, k=4, stats=st_)
    assert 0 < st_.rejected <= st_.rounds
    assert st_.accepted + st_.rejected <= st_.proposed
    assert st_.tokens <= st_.accepted + st_.rounds


@pytest.mark.parametrize("rounds,tokens,want", [(4, 10, 2.5), (1, 5, 5.0), (3, 3, 1.0), (0, 0, 0.0)])
def test_tokens_per_round_is_tokens_over_rounds(rounds, tokens, want):
    assert SpecStats(rounds=rounds, tokens=tokens).tokens_per_round == want
