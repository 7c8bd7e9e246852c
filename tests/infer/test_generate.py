"""Generation's helpers by hand (``minidist.infer.generate``): what a prompt may hold and how long it
may be, request ids, stop tokens and when a sequence is done -- each at its boundary."""

import pytest

from minidist.infer.generate import check_ids, check_prompt, check_prompts, is_done, stop_set


@pytest.mark.parametrize("prompt,new,said", [
    ([0, 7], 0, None),                                      # the smallest and the largest token id
    ([1, 8], 0, "token id 8 at position 1 \\(1 out of range"),
    ([-1, 2, 9], 0, "token id -1 at position 0 \\(2 out of range"),
    ([1] * 6, 2, None),                                     # 6 + 2 = block_size 8, exactly
    ([1] * 6, 3, "6 tokens \\+ max_new_tokens 3 = 9 > block_size 8; ask for at most 2 new tokens"),
    ([1] * 8, 0, None),
    ([1] * 9, 0, "9 tokens, longer than the context \\(block_size 8\\)"),
    ([], 1, "is empty"),
    ([1.0, 2.0], 1, "integer token ids, got dtype float64"),
    ([1], -1, "max_new_tokens must be an integer >= 0, got -1"),
    ([1], True, "max_new_tokens must be an integer >= 0, got True"),
])
def test_check_prompt_boundaries(prompt, new, said):
    if said is None:
        assert check_prompt(prompt, 8, new, "prompt 3", vocab_size=8) == prompt
    else:
        with pytest.raises(ValueError, match=f"^prompt 3:? .*{said}"):
            check_prompt(prompt, 8, new, "prompt 3", vocab_size=8)


def test_check_prompts_names_the_prompt_and_refuses_an_empty_batch():
    with pytest.raises(ValueError, match="rank 1: prompt 1 has token id 8"):
        check_prompts([[1], [8]], 8, 8, 1, "rank 1: ")
    with pytest.raises(ValueError, match="no prompts"):
        check_prompts([], 8, 8, 1)


@pytest.mark.parametrize("ids,n,taken,said", [
    (None, 3, (), None), ([5, 0, 2], 3, (), None), ([1, 2], 2, {3}, None),
    ([1, 1], 2, (), "request id 1 is given twice"),
    ([1, 2], 2, {2}, "request id 2 is given twice"),      # taken by an earlier request
    ([1], 2, (), "2 requests, 1 ids"),
    ([-1, 2], 2, (), "bad ids \\[-1\\]"),
    ([True, 2], 2, (), "bad ids \\[True\\]"),
])
def test_check_ids(ids, n, taken, said):
    if said is None:
        assert check_ids(ids, n, taken=taken) == (list(range(n)) if ids is None else ids)
    else:
        with pytest.raises(ValueError, match=said):
            check_ids(ids, n, taken=taken)


@pytest.mark.parametrize("out,max_new,stop,done", [
    ([], 0, set(), True), ([], 3, {0}, False), ([4, 5], 3, set(), False), ([4, 5, 6], 3, set(), True),
    ([4, 5], 3, {5}, True), ([5, 4], 3, {5}, False),       # only the newest token stops it
    ([7], 1, {9}, True),
])
def test_is_done_at_max_new_tokens_or_a_stop_token_last(out, max_new, stop, done):
    assert is_done(out, max_new, stop) is done


def test_stop_set_takes_none_one_id_or_many():
    assert stop_set(None) == set() and stop_set(3) == {3} and stop_set([3, 3, 4]) == {3, 4}
    with pytest.raises(ValueError, match="stop_tokens must be token ids"):
        stop_set([1.5])
