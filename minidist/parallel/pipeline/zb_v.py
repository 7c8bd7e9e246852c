"""ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024): two chunks per rank in a V.

The model is cut into 2p pieces; rank s holds pieces s and 2p-1-s (`placement.v_shape`). A
microbatch goes down the ranks through chunk 0 and back up through chunk 1, so rank 0 runs both the
first piece and the loss. Two things follow:

* **Memory like 1F1B.** A rank's early chunk waits long for its gradient, its late chunk briefly:
  together about 2p half-stage activations on every rank, 1F1B's stage-0 peak of p microbatches.
  `zb_v` caps each rank at 2p chunk-activations held from F to W.
* **A bubble near zero.** Each piece is half a stage, so the pipeline fills in half-stage steps:
  with B and W split (`zero_bubble`) and F = B = W per stage, the floor is a makespan of
  3m + (p-1)/2 stage-forwards, bubble (p-1)/(6m + p-1) (`zb_v_bubble_formula`).

The order is `zero_bubble.greedy_order` on the V placement; the turn at rank p-1 (piece p-1 to
piece p) is a local hand-off. Deadlock-free with the runtime's background sends (`buffered_sends`);
under strict rendezvous the two directions on one link cross. Needs m >= p. Chapter 5 gives how far
above the floor the greedy order lands.
"""

from __future__ import annotations

from minidist.parallel.pipeline.instructions import check_sizes
from minidist.parallel.pipeline.placement import v_shape
from minidist.parallel.pipeline.zero_bubble import as_schedule, check_min, greedy_order


def zb_v_min_microbatches(num_stages: int) -> int:
    return num_stages


def zb_v_bubble_formula(num_stages: int, num_microbatches: int) -> float:
    """The rectangle bound with F = B = W: (p-1) half-stage steps of fill out of 6m + p - 1."""
    p, m = num_stages, num_microbatches
    return (p - 1) / (6 * m + p - 1)


def zb_v(num_stages: int, num_microbatches: int) -> list[list]:
    """ZB-V's instruction lists (a `Schedule` on the V placement); see the module docstring."""
    check_sizes(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    check_min("zb_v", p, m, zb_v_min_microbatches(p))
    placement = v_shape(p)
    unlimited = 2 * m  # only the memory cap limits forwards
    order = greedy_order(placement, m, lambda r, c: unlimited, held=2 * p)
    return as_schedule(order, placement, buffered_sends=True)
