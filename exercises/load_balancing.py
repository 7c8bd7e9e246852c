"""Exercise 13: balance the load -- cut a pipeline by measured layer times, split a batch by speed.

A pipeline runs at the pace of its slowest stage; a data-parallel step waits for its slowest rank.
Given what was measured (seconds per layer, seconds per row on each rank), decide where the work
goes. Both are small exact algorithms: get them right and the balancer is right.

Estimated time: 45 min

Grade it:  python -m minidist.grade load_balancing
The grader compares your partition with a brute-force search over every contiguous cut, your
shares with a brute-force search over every whole-row split, and trains a linear model on your
rows to check that the global gradient stays exact.
Lesson: lessons/13-load-balancing.md; minidist's answers are in minidist/parallel/pipeline/partition.py
(partition_balanced) and minidist/parallel/balance/shares.py, so try before you look.
"""


def min_max_partition(costs, num_stages):
    """Cut layers 0..n-1 (``costs[i]``: layer i's measured forward+backward seconds) into
    ``num_stages`` contiguous, non-empty stages minimising the largest stage sum.

    Return a list of ``num_stages`` pairs ``(start, end)``: stage s holds layers start..end-1, the
    first starts at 0, each starts where the previous ended, the last ends at n. Any cut achieving
    the smallest possible maximum is accepted. Example: costs [1, 1, 4, 1, 1], 3 stages ->
    [(0, 2), (2, 3), (3, 5)] (stage sums 2, 4, 2). Raise ValueError if num_stages < 1 or
    num_stages > n. Hint: dynamic programming over (stages used, layers placed), O(n^2 p).
    Does not modify its inputs.
    """
    raise NotImplementedError


def balanced_shares(total, seconds_per_row):
    """Split a global batch of ``total`` rows over ranks that take ``seconds_per_row[i]`` per row.

    Return a list of whole numbers n_i, one per rank, with sum(n_i) == total exactly (every row
    of the batch trained on once: the gradient stays that of the whole batch), every n_i >= 1 (a
    rank with no rows has no mean loss), minimising the step time max_i n_i * seconds_per_row[i].
    The real-valued answer is n_i = total * s_i / sum(s) with speeds s_i = 1 / seconds_per_row[i];
    rounding it can cost a whole slow row -- find the best whole split. Raise ValueError if
    total < len(seconds_per_row). Hint: hand out rows one at a time.
    Does not modify its inputs.
    """
    raise NotImplementedError


def my_rows(shares, rank):
    """The rows ``rank`` trains on when rank i takes ``shares[i]`` rows of the global batch, in rank
    order: ``(start, end)`` with rank 0 starting at row 0 and each rank starting where the previous
    ended. Example: shares [3, 1, 2] -> rank 0: (0, 3), rank 1: (3, 4), rank 2: (4, 6).
    Does not modify its inputs.
    """
    raise NotImplementedError
