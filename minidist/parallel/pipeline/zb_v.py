"""ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024): two chunks per rank in a V.

The model is cut into 2p pieces; rank s holds pieces s and 2p-1-s (`placement.v_shape`). A
microbatch goes down the ranks through chunk 0 and back up through chunk 1, so rank 0 runs both
the first piece and the loss. Two things follow:

* **Memory like 1F1B.** A rank's early chunk waits long for its gradient (the round trip through
  every later piece), its late chunk briefly: their in-flight counts add up to about 2p
  half-stage activations on every rank, which is p whole-stage microbatches, 1F1B's stage-0 peak.
  `zb_v` caps each rank at 2p chunk-activations held from F to W.
* **Bubble near zero.** Each piece is half a stage, so the fill and drain of the pipeline take
  half-stage steps: the last rank starts after (p-1) chunk forwards, i.e. (p-1)F/2. With the
  backward split in B and W (`minidist.parallel.pipeline.zero_bubble`) and F = B = W per stage,
  the rectangle bound is a makespan of 3m + (p-1)/2 stage-forwards, bubble (p-1)/(6m + p-1)
  (`zb_v_bubble_formula`); the paper's ZB-V, counted per rank over its own interval, is 0.

The order is `zero_bubble.greedy_order` on the V placement (B first, the later piece first; then F,
the later piece first, within the memory cap; then the oldest W). Simulated with F = B = W, it is
exactly at the bound for m = p and at p = 2, and otherwise at most max(1, p - 3) half-stage steps
above it (0.5 stage-forwards at p = 4, 2.5 at p = 8), below ZB-H1's bubble everywhere.
Communication as ZB-H1's: one SendRecv between compute ops; the turn at rank p-1 (piece p-1 to
piece p) is a local hand-off. Deadlock-free with the runtime's background sends (the schedule
declares `buffered_sends`); under strict rendezvous the two directions on one link cross (rank s
sends piece s's activation down while rank s+1 sends piece 2p-2-s's up). Needs m >= p.
"""

from __future__ import annotations

from minidist.parallel.pipeline.placement import v_shape
from minidist.parallel.pipeline.schedule import _check
from minidist.parallel.pipeline.zero_bubble import as_schedule, check_min, greedy_order


def zb_v_min_microbatches(num_stages: int) -> int:
    return num_stages


def zb_v_bubble_formula(num_stages: int, num_microbatches: int) -> float:
    """The rectangle bound with F = B = W: (p-1) half-stage steps of fill out of 6m + p - 1."""
    p, m = num_stages, num_microbatches
    return (p - 1) / (6 * m + p - 1)


def zb_v(num_stages: int, num_microbatches: int) -> list[list]:
    """ZB-V's instruction lists (a `Schedule` on the V placement); see the module docstring."""
    _check(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    check_min("zb_v", p, m, zb_v_min_microbatches(p))
    placement = v_shape(p)
    unlimited = 2 * m  # only the memory cap limits forwards
    order = greedy_order(placement, m, lambda r, c: unlimited, held=2 * p)
    return as_schedule(order, placement, buffered_sends=True)
