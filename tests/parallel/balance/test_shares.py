"""Shares of a global batch in proportion to throughput: the best whole split (against a brute-force
search over every split) and the balancer's every-k-steps, past-the-margin moves."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist.parallel.balance import (
    ShareBalancer,
    balanced_time,
    offsets,
    proportional_shares,
)
from tests.parallel.balance.helpers import best_split_time

# -- shares --------------------------------------------------------------------------------------

def test_shares_worked_example():
    # 48 rows, rank 2 three times slower (a row takes 1, 1, 3, 1): balanced time 48 / (3 + 1/3) = 14.4.
    # Whole rows: rank 2 with 4 rows (12) leaves 44 for three ranks (15, 15, 14); with 5 (15), 43 (15, 14,
    # 14): the best is 15 either way. Rounding 48 s_i / S = (14.4, 14.4, 4.8, 14.4) would give rank 2
    # 5 or 6 rows: 6 rows take 18.
    n = proportional_shares(48, [1.0, 1.0, 1 / 3, 1.0])
    assert sum(n) == 48 and max(k * t for k, t in zip(n, [1, 1, 3, 1])) == 15 and n[2] in (4, 5)
    assert offsets([14, 14, 6, 14]) == [0, 14, 28, 34]
    assert balanced_time(48, [0.001, 0.001, 0.003, 0.001]) == pytest.approx(48 / (1000 * 3 + 1000 / 3))
    with pytest.raises(ValueError, match="at least 8 rows"):
        proportional_shares(7, [1.0] * 4, minimum=2)




@given(total=st.integers(3, 14), speeds=st.lists(st.sampled_from([0.25, 0.5, 1.0, 1.5, 3.0]), min_size=1,
                                                  max_size=3), minimum=st.integers(0, 2))
def test_shares_are_the_best_whole_split(total, speeds, minimum):
    if total < minimum * len(speeds):
        return
    n = proportional_shares(total, speeds, minimum)
    assert sum(n) == total and min(n) >= minimum
    assert max(k / s for k, s in zip(n, speeds)) == pytest.approx(best_split_time(total, speeds, minimum))
    if minimum == 0:  # no floor: never slower than the balanced time B / S by more than one slowest row
        assert max(k / s for k, s in zip(n, speeds)) <= total / sum(speeds) + 1 / min(speeds) + 1e-9


def test_balancer_moves_only_every_k_steps_and_past_the_margin():
    b = ShareBalancer(48, 4, every=2, margin=0.1)
    assert not b.decide(0, [1.0, 1.0, 3.0, 1.0])              # not a decision step
    assert not b.decide(1, [1.0, 1.0, 1.05, 1.0])             # 5% slower: inside the hysteresis
    assert b.shares == [12, 12, 12, 12]
    assert b.decide(3, [1.0, 1.0, 3.0, 1.0]) and max(np.multiply(b.shares, [1, 1, 3, 1])) == 15  # see above
    assert not b.decide(5, [1.0, 1.0, 3.0, 1.0])              # already balanced: no move


def test_balancer_does_not_move_when_the_saving_is_exactly_the_margin():
    """4 rows on 2 ranks at 1 and 3 s/row: equal shares take max(2·1, 2·3) = 6 s, the best split [3, 1]
    takes max(3·1, 1·3) = 3 s -- exactly half. A margin of 0.5 asks for more than half: no move; 0.4
    moves."""
    b = ShareBalancer(4, 2, every=1, margin=0.5)
    assert not b.decide(0, [1.0, 3.0]) and b.shares == [2, 2] and b.decisions == []
    b = ShareBalancer(4, 2, every=1, margin=0.4)
    assert b.decide(0, [1.0, 3.0]) and b.shares == [3, 1] and b.decisions == [(0, [3, 1])]
