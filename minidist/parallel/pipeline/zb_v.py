"""ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024): two chunks per rank in a V.

The model is cut into 2p pieces; rank s holds pieces s and 2p-1-s (`placement.v_shape`). A
microbatch goes down the ranks through chunk 0 and back up through chunk 1, so rank 0 runs both the
first piece and the loss. Two things follow:

* **Memory like 1F1B.** A rank's early chunk waits long for its gradient, its late chunk briefly:
  together at most 2p half-stage activations on every rank, 1F1B's stage-0 peak of p microbatches.
* **A bubble near zero.** Each piece is half a stage, so the pipeline fills in half-stage steps:
  with B and W split (`zero_bubble`) and F = B = W per stage, the floor is a makespan of
  3m + (p-1)/2 stage-forwards, bubble (p-1)/(6m + p-1) (`zb_v_bubble_formula`).

`zb_v_order` is the paper's handcrafted order (also torch's `ScheduleZBVZeroBubble`): at the floor
for m >= 2p - 1, no rank ever waiting once it has started (chapter 5). Below that, the greedy list
order (`greedy.greedy_order`) under the same memory cap. The turn at rank p-1 is a local hand-off.
Deadlock-free with the runtime's background sends; under strict rendezvous the two directions on
one link cross. Needs m >= p.
"""

from __future__ import annotations

from minidist.parallel.pipeline.greedy import greedy_order
from minidist.parallel.pipeline.instructions import BackwardInput, BackwardWeight, Forward, check_sizes
from minidist.parallel.pipeline.placement import v_shape
from minidist.parallel.pipeline.zero_bubble import as_schedule, check_min


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
    if m >= 2 * p - 1:
        return as_schedule(zb_v_order(p, m), placement)
    unlimited = 2 * m  # only the memory cap limits forwards
    return as_schedule(greedy_order(placement, m, lambda r, c: unlimited, held=2 * p), placement)


def zb_v_order(p: int, m: int) -> list:
    """Each rank's compute order (m >= 2p - 1). Rank r: fill the way down with 2(p-r) - 1 forwards of
    chunk 0; r pairs F1 F0 as the first microbatches come back up; p - r of F1 B1 W1 as the loss's
    gradients arrive; then F0 B0 W0 F1 B1 W1 until all forwards ran; then r pairs B0 B1 with their W's
    put off, p - r pairs B0 W0, and the W's left, chunk 1's first."""
    order = []
    for r in range(p):
        o = _Ops()
        for _ in range(2 * (p - r) - 1):
            o.f(0)
        for _ in range(r):
            o.f(1), o.f(0)
        for _ in range(p - r):
            o.f(1), o.b(1), o.w(1)
        for _ in range(m - p):
            if o.n[Forward, 0] < m:
                o.f(0)
            o.b(0), o.w(0), o.f(1), o.b(1), o.w(1)
        for _ in range(r):
            o.b(0), o.b(1)
        for _ in range(p - r):
            o.b(0), o.w(0)
        for c in (1, 0):
            while o.n[BackwardWeight, c] < m:
                o.w(c)
        order.append(list(o))
    return order


class _Ops(list):
    """One rank's compute ops, each chunk's microbatches counted: f(c), b(c) (B), w(c) (W) run the next."""

    def __init__(self):
        super().__init__()
        self.n = {(kind, c): 0 for kind in (Forward, BackwardInput, BackwardWeight) for c in (0, 1)}

    def add(self, kind, c):
        self.append(kind(self.n[kind, c], c))
        self.n[kind, c] += 1

    def f(self, c):
        self.add(Forward, c)

    def b(self, c):
        self.add(BackwardInput, c)

    def w(self, c):
        self.add(BackwardWeight, c)
