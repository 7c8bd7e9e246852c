"""Grader for exercises/load_balancing.py: the min-max contiguous partition and the whole-row shares.

``CHECKS[task](impl)`` raises AssertionError when ``impl.<task>`` is wrong. Partitions are held to a
brute-force search over every contiguous cut, shares to a brute-force search over every whole-row
split, and the rows (``my_rows``) to the gradient of a linear model over the whole batch. In CI they
run against minidist's own code (``reference``: must pass) and the deliberately broken versions in
``BROKEN`` (must fail); ``python -m minidist.grade load_balancing`` runs them on a student's file.
"""

import itertools
import math
import types

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minidist.grading import untouched
from minidist.parallel.balance.shares import offsets, proportional_shares
from minidist.parallel.pipeline.partition import partition_balanced

GRADE = settings(max_examples=30, deadline=None, derandomize=True, database=None, report_multiple_bugs=False)


def _best_cut(costs, p):
    """The smallest possible largest stage sum, by trying every way to cut (written here, not imported)."""
    n, best = len(costs), math.inf
    for cuts in itertools.combinations(range(1, n), p - 1):
        edges = [0, *cuts, n]
        best = min(best, max(sum(costs[a:b]) for a, b in zip(edges[:-1], edges[1:])))
    return best


def _must_raise_value_error(message, fn, *args):
    """``fn(*args)`` must raise ValueError; returning (or another error, which propagates) fails the task."""
    try:
        fn(*args)
    except ValueError:
        return
    raise AssertionError(message)


def check_min_max_partition(impl):
    @GRADE
    @given(costs=st.lists(st.integers(1, 30), min_size=1, max_size=8), p=st.integers(1, 4))
    @example(costs=[1, 1, 4, 1, 1], p=3)  # the spec's example, tried first
    def prop(costs, p):
        if p > len(costs):
            return
        what = f"min_max_partition({costs}, {p})"
        got = untouched(impl.min_max_partition)(list(costs), p)
        got = [tuple(b) for b in got]
        assert len(got) == p, f"{what} returned {len(got)} stages"
        assert got[0][0] == 0 and got[-1][1] == len(costs), f"{what} = {got} must start at 0 and end at n"
        for (_, b), (c, _) in zip(got, got[1:]):
            assert b == c, f"{what} = {got}: each stage must start where the previous ended"
        assert all(a < b for a, b in got), f"{what} = {got}: every stage needs at least one layer"
        worst, want = max(sum(costs[a:b]) for a, b in got), _best_cut(costs, p)
        assert worst == want, f"{what} = {got}: slowest stage {worst}, the best cut has {want}"
    prop()
    for costs, p in [([1, 2, 3], 0), ([1, 2], 3)]:
        _must_raise_value_error(f"min_max_partition({costs}, {p}) must raise ValueError (1 <= p <= layers)",
                                impl.min_max_partition, costs, p)


def _best_split(total, t):
    """Smallest max_i n_i t_i over every split with n_i >= 1 summing to total (brute force)."""
    splits = [ns for ns in itertools.product(range(1, total + 1), repeat=len(t)) if sum(ns) == total]
    return min(max(n * x for n, x in zip(ns, t)) for ns in splits)


def check_balanced_shares(impl):
    @GRADE
    @given(total=st.integers(2, 12), t=st.lists(st.sampled_from([1.0, 2.0, 3.0, 0.5]), min_size=1,
                                                 max_size=3))
    # rounding 6 s_i / S = (1.5, 4.5) up for the slow rank: [2, 4] takes 6 s, the best [1, 5] 5 s
    @example(total=6, t=[3.0, 1.0])
    @example(total=3, t=[1.0, 3.0])  # the best split with no floor starves the slow rank: [3, 0]
    def prop(total, t):
        if total < len(t):
            return
        what = f"balanced_shares({total}, {t})"
        n = [int(v) for v in untouched(impl.balanced_shares)(total, list(t))]
        assert len(n) == len(t), f"{what} = {n}: one share per rank"
        assert sum(n) == total, f"{what} = {n} sums to {sum(n)}: each row once keeps the gradient exact"
        assert min(n) >= 1, f"{what} = {n}: every rank needs at least one row"
        got, want = max(k * x for k, x in zip(n, t)), _best_split(total, t)
        assert abs(got - want) < 1e-12, f"{what} = {n}: step time {got}, the best whole split takes {want}"
    prop()
    _must_raise_value_error("balanced_shares(2, [1, 1, 1]) must raise ValueError (fewer rows than ranks)",
                            impl.balanced_shares, 2, [1.0, 1.0, 1.0])


def check_my_rows(impl):
    @GRADE
    @given(shares=st.lists(st.integers(1, 6), min_size=1, max_size=5), seed=st.integers(0, 3))
    @example(shares=[3, 1, 2], seed=0)
    def prop(shares, seed):
        total = sum(shares)
        rows = [tuple(untouched(impl.my_rows)(list(shares), r)) for r in range(len(shares))]
        covered = [i for a, b in rows for i in range(a, b)]
        assert covered == list(range(total)), f"my_rows({shares}, r) for each r = {rows}: must cover rows " \
                                              f"0..{total - 1} once each, in rank order"
        # the gradient stays exact: ranks' mean gradients weighted by their rows = the whole batch's mean
        rng = np.random.default_rng(seed)
        x, y, w = rng.standard_normal((total, 3)), rng.standard_normal(total), rng.standard_normal(3)
        per_row = x * (x @ w - y)[:, None]           # d/dw of (x.w - y)^2 / 2, row by row
        combined = sum((b - a) * per_row[a:b].mean(axis=0) for a, b in rows) / total
        np.testing.assert_allclose(combined, per_row.mean(axis=0), rtol=1e-12, atol=1e-12)
    prop()


CHECKS = {"min_max_partition": check_min_max_partition, "balanced_shares": check_balanced_shares,
          "my_rows": check_my_rows}


def reference():
    return types.SimpleNamespace(
        min_max_partition=partition_balanced,
        balanced_shares=lambda total, t: proportional_shares(total, [1.0 / x for x in t], minimum=1),
        my_rows=lambda shares, rank: (offsets(shares)[rank], offsets(shares)[rank] + shares[rank]))


# -- deliberately broken implementations (must fail) ---------------------------------------------

def _uniform_cut(costs, p):  # ignores the costs: equal layer counts
    if not 1 <= p <= len(costs):
        raise ValueError("bad p")
    ends = np.cumsum([len(costs) // p + (i < len(costs) % p) for i in range(p)]).tolist()
    return list(zip([0] + ends[:-1], ends))


def _greedy_fill(costs, p):  # close a stage once it reaches the average: misses the optimum
    if not 1 <= p <= len(costs):
        raise ValueError("bad p")
    target, bounds, start, acc = sum(costs) / p, [], 0, 0.0
    for i, c in enumerate(costs):
        acc += c
        left_layers, left_stages = len(costs) - i - 1, p - len(bounds) - 1
        if left_stages > 0 and (acc >= target or left_layers == left_stages):
            bounds.append((start, i + 1))
            start, acc = i + 1, 0.0
    bounds.append((start, len(costs)))
    return bounds


def _rounded_proportions(total, t):  # largest remainders of total * s_i / S: a slow rank keeps a row too many
    if total < len(t):
        raise ValueError("too few rows")
    s = [1.0 / x for x in t]
    exact = [total * v / sum(s) for v in s]
    n = [max(1, math.floor(e)) for e in exact]
    for i in sorted(range(len(t)), key=lambda i: exact[i] - math.floor(exact[i]), reverse=True):
        if sum(n) >= total:
            break
        n[i] += 1
    while sum(n) > total:
        n[n.index(max(n))] -= 1
    return n


def _equal_shares(total, t):  # ignores the speeds
    if total < len(t):
        raise ValueError("too few rows")
    return [total // len(t) + (i < total % len(t)) for i in range(len(t))]


def _may_starve(total, t):  # the best split, but a slow rank may get zero rows
    if total < len(t):
        raise ValueError("too few rows")
    return proportional_shares(total, [1.0 / x for x in t], minimum=0)


def _rows_overlap(shares, rank):  # every rank starts at rank * shares[rank]: wrong once shares differ
    return rank * shares[rank], (rank + 1) * shares[rank]


def _prefix_sums_in_place(costs, num_stages):  # turns the caller's list into its prefix sums
    prefix = costs
    for i in range(1, len(prefix)):
        prefix[i] += prefix[i - 1]
    return partition_balanced([b - a for a, b in zip([0] + prefix[:-1], prefix)], num_stages)


BROKEN = {"min_max_partition": [_uniform_cut, _greedy_fill, _prefix_sums_in_place],
          "balanced_shares": [_rounded_proportions, _equal_shares, _may_starve],
          "my_rows": [_rows_overlap]}

