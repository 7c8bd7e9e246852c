"""``repartition.py``: the flow-shop step time of a cut, its bubble, when a move pays off, and what a
layer costs the stage holding it (``move_layers`` itself: ``test_pipeline.py``, training across moves)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist.parallel.balance.repartition import bubble, layer_memory_bytes, pays_off, step_time


@given(costs=st.lists(st.floats(0.1, 5.0), min_size=1, max_size=5), m=st.integers(1, 8))
def test_step_time_is_the_flow_shop_of_m_identical_microbatches(costs, m):
    # microbatch j leaves stage s at C[j][s] = max(C[j-1][s], C[j][s-1]) + c_s / m
    done = np.zeros((m + 1, len(costs) + 1))
    for j in range(1, m + 1):
        for s in range(1, len(costs) + 1):
            done[j, s] = max(done[j - 1, s], done[j, s - 1]) + costs[s - 1] / m
    assert step_time(costs, m) == pytest.approx(done[m, len(costs)])


def test_moving_pays_off_only_when_the_saving_covers_the_move():
    assert pays_off(t_now=1.0, t_new=0.8, steps_left=10, move_seconds=1.9)      # saves 2.0 s
    assert not pays_off(t_now=1.0, t_new=0.8, steps_left=10, move_seconds=2.1)


@pytest.mark.parametrize("optimizer,state_arrays", [("sgd", 0), ("adamw", 2)])
@pytest.mark.parametrize("dtype,itemsize", [(np.float32, 4), (np.float64, 8)])
def test_a_layers_memory_is_its_parameters_their_optimizer_state_and_the_activations_in_flight(
        optimizer, state_arrays, dtype, itemsize):
    """A Linear(4, 3) holds 12 + 3 parameters; AdamW keeps m and v for each (SGD without momentum
    nothing); 1F1B keeps min(m, p) microbatches of activations: written out by hand."""
    from minidist.nn import Linear
    want = 15 * itemsize * (1 + state_arrays) + 100 * 2
    assert layer_memory_bytes(Linear(4, 3, dtype=dtype), optimizer, 100, 2) == want


def test_moving_pays_off_only_when_the_saving_exceeds_the_move_not_when_it_equals_it():
    # (1.0 - 0.5) x 4 = 2.0 exactly: a move costing 2.0 s saves nothing, so it is not made
    assert not pays_off(t_now=1.0, t_new=0.5, steps_left=4, move_seconds=2.0)
    assert pays_off(t_now=1.0, t_new=0.5, steps_left=4, move_seconds=1.999)
    assert not pays_off(t_now=1.0, t_new=1.0, steps_left=100, move_seconds=0.0)


@pytest.mark.parametrize("p,m", [(2, 1), (4, 4), (4, 8), (3, 5)])
def test_bubble_of_equal_stages_is_the_textbook_fraction(p, m):
    """Equal stages: the idle share of p stages x the step is (p-1)/(m+p-1) (GPipe / 1F1B's bubble)."""
    assert bubble([2.0] * p, m) == pytest.approx((p - 1) / (m + p - 1))
    # one stage twice as slow (p=2, m=2): T = (1+2)/2 + 1·2/2 = 2.5; busy 3 of 2 x 2.5 = 5: bubble 0.4
    assert bubble([1.0, 2.0], 2) == pytest.approx(0.4)
