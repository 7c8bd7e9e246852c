"""Sampling's distribution (``filter_probs``) at the edges of top-k and top-p, by hand: equal logits
make every probability a power of two, so a cumulative mass lands exactly on top_p."""

import numpy as np
import pytest

from minidist.infer.sampling import SamplingParams, filter_probs

FOUR = np.zeros(4)  # p = 1/4 each, exactly


@pytest.mark.parametrize("top_p,want", [
    (0.25, [1, 0, 0, 0]),          # the mass above token 1 is 0.25 = top_p: it is not kept
    (0.26, [0.5, 0.5, 0, 0]),
    (0.5, [0.5, 0.5, 0, 0]),       # token 2 has exactly 0.5 above it: left out
    (0.75, [1 / 3, 1 / 3, 1 / 3, 0]),
    (1.0, [0.25] * 4),
])
def test_top_p_keeps_the_tokens_with_less_than_top_p_mass_above_them(top_p, want):
    assert filter_probs(FOUR, SamplingParams(1.0, top_p=top_p)).tolist() == want


@pytest.mark.parametrize("top_k,want", [(1, [1, 0, 0]), (2, [2 / 3, 1 / 3, 0]), (3, [4 / 7, 2 / 7, 1 / 7]),
                                        (5, [4 / 7, 2 / 7, 1 / 7])])
def test_top_k_keeps_the_k_most_likely(top_k, want):
    logits = np.log([4.0, 2.0, 1.0])
    np.testing.assert_allclose(filter_probs(logits, SamplingParams(1.0, top_k=top_k)), want, rtol=1e-12)


def test_temperature_divides_the_logits():
    """logits (0, ln 4) at temperature 2 are (0, ln 2): probabilities 1/3, 2/3."""
    np.testing.assert_allclose(filter_probs(np.log([1.0, 4.0]), SamplingParams(2.0)), [1 / 3, 2 / 3])
