"""The placement-aware cut (`partition_for`, `partition_v`) against every cut, enumerated."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist.parallel.pipeline.partition import (
    partition_balanced,
    partition_for,
    partition_uniform,
    partition_v,
)
from minidist.parallel.pipeline.partition import rank_loads as library_rank_loads
from minidist.parallel.pipeline.placement import looped, v_shape


def rank_loads(bounds, costs, placement):
    """Each rank's summed cost under `placement` (the owner of piece k from Placement, not the cut)."""
    loads = [0.0] * placement.num_stages
    for k, (a, b) in enumerate(bounds):
        loads[placement.owner(k)[0]] += sum(costs[a:b])
    return loads


def every_cut(n, pieces):
    for inner in itertools.combinations(range(1, n), pieces - 1):
        ends = [0, *inner, n]
        yield list(zip(ends[:-1], ends[1:]))


def best_by_enumeration(costs, placement, memory=None, cap=None):
    """(busiest rank, then largest piece) over every contiguous cut that fits the cap; busiest ranks
    a rounding apart count as equal (sums of the same costs in another order)."""
    scores = []
    for bounds in every_cut(len(costs), placement.num_virtual):
        if cap is not None and max(rank_loads(bounds, memory, placement)) > cap:
            continue
        scores.append((max(rank_loads(bounds, costs, placement)), max(sum(costs[a:b]) for a, b in bounds)))
    if not scores:
        return None
    busiest = min(s[0] for s in scores)
    return busiest, min(s[1] for s in scores if s[0] <= busiest * (1 + 1e-9))


def covers(bounds, n, pieces):
    assert len(bounds) == pieces
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a < b for a, b in bounds)
    assert all(bounds[k][1] == bounds[k + 1][0] for k in range(pieces - 1))


@given(p=st.integers(1, 3), extra=st.integers(0, 4), data=st.data())
def test_the_v_cut_is_the_best_of_every_cut_for_the_busiest_rank_then_the_largest_piece(p, extra, data):
    n = 2 * p + extra
    costs = data.draw(st.lists(st.floats(0.01, 10.0), min_size=n, max_size=n))
    bounds = partition_v(costs, p)
    covers(bounds, n, 2 * p)
    v = v_shape(p)
    got = (max(rank_loads(bounds, costs, v)), max(sum(costs[a:b]) for a, b in bounds))
    want = best_by_enumeration(costs, v)
    assert got == pytest.approx(want, rel=1e-9)


@given(p=st.integers(1, 3), extra=st.integers(0, 3), data=st.data())
def test_the_v_cut_keeps_every_rank_within_the_memory_cap(p, extra, data):
    n = 2 * p + extra
    costs = data.draw(st.lists(st.floats(0.01, 10.0), min_size=n, max_size=n))
    memory = data.draw(st.lists(st.integers(1, 5), min_size=n, max_size=n))
    cap = data.draw(st.integers(1, sum(memory)))
    v = v_shape(p)
    want = best_by_enumeration(costs, v, memory, cap)
    if want is None:
        with pytest.raises(ValueError, match="memory cap"):
            partition_v(costs, p, memory, cap)
        return
    bounds = partition_v(costs, p, memory, cap)
    covers(bounds, n, 2 * p)
    assert max(rank_loads(bounds, memory, v)) <= cap
    assert max(rank_loads(bounds, costs, v)) == pytest.approx(want[0], rel=1e-9)


def test_a_gpt_cut_for_the_v_balances_the_ranks_where_balancing_the_pieces_does_not():
    """Embedding 0.1, six blocks of 1, head 0.3 on a V of 2 ranks (rank 0: pieces 0 and 3). Balanced
    pieces (at most 2 each) leave rank 1 four blocks (4.0) and rank 0 2.4; so does the uniform cut.
    Worked by hand: rank 1 takes three blocks (3.0), rank 0 the rest (3.4); of those cuts, the one
    with the smallest piece at most 2.1 (embedding and two blocks)."""
    costs = [0.1] + [1.0] * 6 + [0.3]
    v = v_shape(2)
    assert rank_loads(partition_uniform(8, 4), costs, v) == pytest.approx([2.4, 4.0])
    assert rank_loads(partition_balanced(costs, 4), costs, v) == pytest.approx([2.4, 4.0])
    bounds = partition_v(costs, 2)
    assert bounds == [(0, 3), (3, 4), (4, 6), (6, 8)]
    assert rank_loads(bounds, costs, v) == pytest.approx([3.4, 3.0])
    assert library_rank_loads(partition_uniform(8, 4), costs, v) == pytest.approx([2.4, 4.0])
    assert library_rank_loads(bounds, costs, v) == pytest.approx([3.4, 3.0])


def test_partition_for_asks_the_placement():
    costs = [0.1, 2.0, 1.0, 1.0, 3.0, 0.5, 1.0, 0.2]
    assert partition_for(costs, looped(2)) == partition_balanced(costs, 2)
    assert partition_for(costs, looped(2, 2)) == partition_balanced(costs, 4)
    assert partition_for(costs, v_shape(2)) == partition_v(costs, 2)


def test_a_v_needs_two_layers_a_rank():
    with pytest.raises(ValueError, match="5 layers are too few; use at most 2 ranks"):
        partition_v([1.0] * 5, 3)


def test_a_v_refuses_a_stage_count_that_is_not_a_positive_int():
    with pytest.raises(ValueError, match="got 2.0"):
        partition_v([1.0] * 4, 2.0)
    with pytest.raises(ValueError, match="a V needs 2 layers or more"):
        partition_v([1.0], 1)
