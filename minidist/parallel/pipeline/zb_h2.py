"""ZB-H2 (Qi et al., ICLR 2024): ZB-H1 with a longer warm-up, its W's filling the whole cool-down.

Stage s runs 2(p - s) - 1 warm-up forwards (2p - 1 microbatches held on stage 0, about twice 1F1B's
memory). The order is what the greedy list scheduler (`greedy.greedy_order`) picks in unit steps
under those limits: B as soon as its gradient is here, else F, else the oldest put-off W. With
F = B = W it reaches the floor 3m + p - 1 of one synchronised step, and every stage works without a
gap from its first op to its last (the paper's bubble over each stage's own interval,
(p-1)(F + B - 2W), is 0); ZB-H1 reaches the same step at 1F1B's memory. Needs m >= 2p - 1.
"""

from __future__ import annotations

from minidist.parallel.pipeline.greedy import greedy_order
from minidist.parallel.pipeline.instructions import check_sizes
from minidist.parallel.pipeline.placement import looped
from minidist.parallel.pipeline.zero_bubble import as_schedule, check_min, zb_h1_bubble_formula


def zb_h2_min_microbatches(num_stages: int) -> int:
    return 2 * num_stages - 1


def zb_h2_bubble_formula(num_stages: int, num_microbatches: int) -> float:
    """ZB-H2's bubble with F = B = W in the rectangle (one synchronised step): the bound (p-1)/(3m+p-1);
    over each stage's own interval (the paper's parallelogram) it is (p-1)(F + B - 2W) = 0."""
    return zb_h1_bubble_formula(num_stages, num_microbatches)


def zb_h2(num_stages: int, num_microbatches: int) -> list[list]:
    """ZB-H2's instruction lists (see the module docstring); background sends, as every zero-bubble
    schedule here (under strict rendezvous it runs but waits)."""
    check_sizes(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    check_min("zb_h2", p, m, zb_h2_min_microbatches(p))
    order = greedy_order(looped(p), m, lambda s, c: 2 * (p - s) - 1, held=2 * p - 1)
    return as_schedule(order, looped(p))
