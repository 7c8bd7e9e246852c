"""Recompute policies by number (``minidist.parallel.memory.recompute_policy``): segment sizes and
one block's saved elements, worked out by hand; the peak formula itself is checked against the
measured peak in ``tests/parallel/memory/test_recompute.py``."""

import pytest

from minidist.parallel.memory.recompute_policy import block_activation_elements, segment_size


@pytest.mark.parametrize("policy,n,k,want", [("full", 7, None, 1), ("every_k", 7, 3, 3),
                                             ("sqrt", 9, None, 3), ("sqrt", 10, None, 3),  # round(3.16)
                                             ("sqrt", 13, None, 4), ("sqrt", 1, None, 1)])  # round(3.61)
def test_segment_size_by_policy(policy, n, k, want):
    assert segment_size(policy, n, k) == want


@pytest.mark.parametrize("policy,k", [("every_k", None), ("every_k", 0), ("none", None), ("selective", None)])
def test_a_policy_without_segments_or_a_bad_k_is_a_clear_error(policy, k):
    with pytest.raises(ValueError, match=policy if policy != "every_k" else "k >= 1"):
        segment_size(policy, 4, k)


def test_one_blocks_saved_elements_by_hand():
    """b=2, t=3, c=4, h=2: BTC = 24, BT = 6. Before the core: ln1 (24 + 6), the qkv input (24), q, k, v
    (72) = 126; the probabilities B·H·T² = 36; after: out-proj input 24, ln2 30, fc input 24, GELU 192,
    mlp-proj input 96 = 366; dropout masks 2·24 = 48 (0 without dropout)."""
    assert block_activation_elements(2, 3, 4, 2, dropout=True) == {
        "before_core": 126, "probs": 36, "after_core": 366, "dropout": 48}
    assert block_activation_elements(2, 3, 4, 2, dropout=False)["dropout"] == 0
