"""Serving refuses what would go wrong in silence (issue 40): a request id given twice, logits that are
NaN or inf (named by request and step, greedy and sampled alike), a decode rank whose model is not the
prefill rank's, ranks handed different requests (named at once, not after MINIDIST_TIMEOUT), and bad
sampling arguments."""

import re
import time
from functools import cache

import numpy as np
import pytest

from minidist.comm import run
from minidist.infer import (
    GREEDY,
    Request,
    SamplingParams,
    Scheduler,
    early_exit_draft,
    generate,
    generate_recompute,
    route,
    serve,
    speculative_generate,
)
from minidist.infer.colocated import colocated_serve
from minidist.infer.disaggregated import disaggregated_serve
from minidist.nn import GPT, GPTConfig

V = 32
SAMPLED = SamplingParams(temperature=1.0, top_k=8, seed=3)


def gpt(seed=2, vocab=V):
    return GPT(GPTConfig(vocab_size=vocab, block_size=48, n_layer=2, n_head=2, d_model=32, seed=seed)).eval()


@cache
def model():
    return gpt()


def edited(m, key, rows, value):
    """``m`` with ``state_dict()[key][rows] = value`` (on a copy of that array)."""
    sd = {k: np.array(v) for k, v in m.state_dict().items()}
    sd[key][rows] = value
    m.load_state_dict(sd)
    return m.eval()


def poisoned_after_first_token(prompt, sampling=GREEDY, value=np.nan, stream=0):
    """A model whose embedding row of the token the healthy model emits first is ``value``: the prefill
    (a prompt without that token) is finite and emits it, so step 1 -- the pass that feeds it -- is the
    first whose logits are not finite."""
    first = generate(model(), [prompt], 1, sampling, ids=[stream])[0][0]
    assert first not in prompt
    return edited(gpt(), "0.wte.weight", first, value)


def nan_head(m=None):
    m = gpt() if m is None else m
    return edited(m, f"{m.config.n_layer + 1}.proj.weight", slice(None), np.nan)


# -- duplicate request ids ------------------------------------------------------------------------------

def dup_requests():
    return [Request(1, [1, 2, 3], 4), Request(2, [5], 2), Request(1, [4, 5], 4)]


def test_a_duplicate_request_id_is_refused_at_submission_and_nothing_runs():
    with pytest.raises(ValueError, match=r"request id 1 is given twice: ids must be unique"):
        serve(model(), dup_requests())
    s = Scheduler(model(), max_batch=2)
    s.submit(Request(1, [1, 2, 3], 4))
    with pytest.raises(ValueError, match="request id 1 is given twice"):
        s.submit(Request(1, [4, 5], 4))
    assert [r.id for r in s.pending] == [1] and s.stats["steps"] == 0  # the first is kept, untouched


@pytest.mark.parametrize("serving", ["colocated", "disaggregated"])
def test_a_duplicate_request_id_is_refused_on_every_rank_in_distributed_serving(serving):
    fn = colocated_serve if serving == "colocated" else disaggregated_serve
    errors = []

    def rank(comm):
        try:
            fn(comm, model(), dup_requests())
        except ValueError as e:
            errors.append(str(e))

    run(rank, 2)
    # before the fix both ranks returned {1: ...}: one answer lost, both sharing request 1's stream
    assert sorted(e.split(":")[0] for e in errors) == ["rank 0", "rank 1"]
    assert all("request id 1 is given twice" in e for e in errors)


def test_route_and_generate_refuse_a_repeated_id_and_ids_that_do_not_fit():
    with pytest.raises(ValueError, match="route: request id 1 is given twice"):
        route(model(), dup_requests(), [0.0, 0.0, 0.0], replicas=3)  # each on its own replica
    with pytest.raises(ValueError, match="request id 4 is given twice"):
        generate(model(), [[1], [2]], 2, ids=[4, 4])
    for ids, said in (([0], "2 requests, 1 ids"), ([0, 1, 2], "2 requests, 3 ids"),
                      ([0, -1], r"bad ids \[-1\]"), ([0, 1.5], r"bad ids \[1.5\]"), (["a", 1], "bad ids")):
        for gen in (generate, generate_recompute):
            with pytest.raises(ValueError, match=said):
                gen(model(), [[1], [2]], 2, ids=ids)
        with pytest.raises(ValueError, match=said):
            speculative_generate(model(), early_exit_draft(model(), 1), [[1], [2]], 2, ids=ids)
    with pytest.raises(ValueError, match=r"request ids must be integers >= 0.*bad ids \['x'\]"):
        serve(model(), [Request("x", [1], 2)])


# -- non-finite logits ----------------------------------------------------------------------------------

@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_nonfinite_logits_name_the_request_and_the_step_in_generate_and_serve(sampling, value):
    prompt = [3, 4, 5]
    m = poisoned_after_first_token(prompt, sampling, value, stream=7)
    # the hand-worked step: 0 is the prefill (finite), 1 feeds the poisoned token
    for call in (lambda: generate(m, [prompt], 4, sampling, ids=[7]),
                 lambda: generate_recompute(m, [prompt], 4, sampling, ids=[7]),
                 lambda: serve(m, [Request(7, prompt, 4, sampling)])):
        with pytest.raises(FloatingPointError, match=r"request 7, step 1: the model's logits hold NaN or"):
            call()


def test_nonfinite_logits_are_named_in_speculative_decoding_target_and_draft():
    for sampling in (GREEDY, SAMPLED):
        # before the fix: greedy returned [0, 0, 0] in silence, sampling went on from NaN probabilities
        bad = nan_head()
        with pytest.raises(FloatingPointError, match=r"request 5, step 0: the target's logits"):
            speculative_generate(bad, early_exit_draft(bad, 1), [[1, 2]], 3, sampling=sampling, ids=[5])
        # a NaN draft would be rejected every round (right tokens, acceptance 0): said, not hidden
        draft = nan_head(early_exit_draft(model(), 1))
        with pytest.raises(FloatingPointError, match=r"request 5, step 1: the draft's logits"):
            speculative_generate(model(), draft, [[1, 2]], 3, sampling=sampling, ids=[5])


@pytest.mark.parametrize("where", ["prefill", "decode"])
def test_nonfinite_logits_are_named_on_the_disaggregated_rank_that_meets_them(where):
    prompt = [3, 4, 5]
    bad = nan_head() if where == "prefill" else poisoned_after_first_token(prompt, stream=9)
    step = 0 if where == "prefill" else 1  # the prefill rank samples step 0, the decode rank the rest
    with pytest.raises(FloatingPointError, match=rf"request 9, step {step}: the model's logits"):
        run(lambda comm: disaggregated_serve(comm, bad, [Request(9, prompt, 4)]), 2)


def test_a_sampled_nonfinite_row_is_refused_before_numpy_sees_it():
    from minidist.infer.sampling import sample
    logits = np.zeros((3, V))
    logits[2, 5] = np.nan
    rngs = [np.random.default_rng(i) for i in range(3)]
    for params in (GREEDY, SAMPLED):
        with pytest.raises(FloatingPointError, match="request 12, step 4"):
            sample(logits, params, rngs, ids=[10, 11, 12], step=4)
    logits[2, 5] = -np.inf  # an overflow either way: the model's logits are never -inf by design
    with pytest.raises(FloatingPointError, match="request 2, step 0"):
        sample(logits, GREEDY, rngs)  # ids default to the row numbers
    logits[2, 5] = 1e30  # large but finite: sampled, not refused
    assert sample(logits, GREEDY, rngs) == [0, 0, 5]


# -- every rank must serve one model and one list of requests ------------------------------------------

def served_on_two_ranks(fn, model_of_rank, requests_of_rank):
    errors, t0 = [], time.perf_counter()

    def rank(comm):
        try:
            return fn(comm, model_of_rank(comm.rank), requests_of_rank(comm.rank)).outputs
        except ValueError as e:
            errors.append(str(e))

    out = run(rank, 2)
    return out, sorted(errors), time.perf_counter() - t0


def test_a_decode_rank_refuses_a_model_that_is_not_the_prefill_ranks():
    one = [Request(0, [1, 2, 3], 4)]
    cases = [  # (rank 1's model, what the error names)
        (gpt(vocab=40), r"other model config than rank 0 \({'vocab_size': 40} against {'vocab_size': 32}\)"),
        (edited(gpt(), "1.attn.qkv.weight", (0, 0), 0.5), r"other model weights \(sha256\)"),  # one weight
    ]
    for other, said in cases:
        out, errors, _ = served_on_two_ranks(disaggregated_serve, lambda r, o=other: model() if r == 0 else o,
                                             lambda r: one)
        # before the fix: the decode rank decoded rank 0's cache with its own model, in silence
        assert out == [None, None] and len(errors) == 2, (out, errors)
        assert [e.split(":")[0] for e in errors] == ["rank 0", "rank 1"]
        assert all("ranks [1]" in e and re.search(said, e) for e in errors), errors
    # the same weights under another init seed are the same model: served, token for token
    same = gpt(seed=5)
    same.load_state_dict(model().state_dict())
    out, errors, _ = served_on_two_ranks(disaggregated_serve, lambda r: model() if r == 0 else same.eval(),
                                         lambda r: one)
    assert not errors and out[0] == out[1] == {0: generate(model(), [[1, 2, 3]], 4)[0]}


@pytest.mark.parametrize("serving", ["colocated", "disaggregated"])
def test_ranks_handed_different_requests_are_named_at_once_not_after_the_timeout(serving, monkeypatch):
    monkeypatch.setenv("MINIDIST_TIMEOUT", "4")  # before the fix disaggregated serving waited this long
    fn = colocated_serve if serving == "colocated" else disaggregated_serve
    base = [Request(0, [1, 2], 3), Request(1, [3], 2)]
    more = lambda r: base + ([Request(2, [3, 4], 3)] if r == 1 else [])  # noqa: E731
    out, errors, seconds = served_on_two_ranks(fn, lambda r: model(), more)
    # before the fix colocated serving returned in silence without request 2
    assert out == [None, None] and seconds < 3, (out, errors, seconds)
    assert all("ranks [1] hold other requests (count, sha256) than rank 0 ((3, " in e for e in errors)
    other = lambda r: [base[0], Request(1, [3], 2 if r == 0 else 3)]  # noqa: E731 - same count, not the same
    out, errors, seconds = served_on_two_ranks(fn, lambda r: model(), other)
    assert out == [None, None] and seconds < 3 and all("other requests (count, sha256)" in e for e in errors)


# -- arguments ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, said", [
    ({"top_k": 2.5}, "top_k must be an integer >= 1 or None, got 2.5"),
    ({"top_k": True}, "top_k must be an integer >= 1 or None, got True"),
    ({"top_k": 0}, "top_k must be an integer >= 1 or None, got 0"),
    ({"seed": -1}, "seed must be an integer >= 0, got -1"),
    ({"seed": 1.5}, "seed must be an integer >= 0, got 1.5"),
    ({"seed": None}, "seed must be an integer >= 0, got None"),
])
def test_sampling_params_refuse_what_numpy_would_choke_on(kw, said):
    with pytest.raises(ValueError, match=re.escape(said)):
        SamplingParams(temperature=1.0, **kw)
    SamplingParams(temperature=1.0, top_k=np.int64(2), seed=np.int64(0))  # NumPy integers are integers


def test_stop_tokens_none_means_no_stop_tokens_and_one_id_means_that_id():
    free = generate(model(), [[1, 2]], 6)[0]
    assert generate(model(), [[1, 2]], 6, stop_tokens=None)[0] == free
    stop = free[2]
    want = free[:free.index(stop) + 1]  # the first occurrence ends it, included
    for stops in (stop, [stop], {stop}, (np.int64(stop),)):
        assert generate(model(), [[1, 2]], 6, stop_tokens=stops)[0] == want
        assert serve(model(), [Request(0, [1, 2], 6, stop_tokens=stops)])[0] == {0: want}
    assert serve(model(), [Request(0, [1, 2], 6, stop_tokens=None)])[0] == {0: free}
    for bad in ("ab", [1.5], [None]):
        with pytest.raises(ValueError, match="stop_tokens must be token ids"):
            generate(model(), [[1, 2]], 3, stop_tokens=bad)
        with pytest.raises(ValueError, match="stop_tokens must be token ids"):
            Request(0, [1, 2], 3, stop_tokens=bad)


def test_prompts_that_are_not_a_list_are_named():
    with pytest.raises(ValueError, match=r"no prompts: pass a list of at least one prompt"):
        generate(model(), 5, 3)
