"""DualPipeV (DeepSeek-V3's DualPipe "cut in half", as DeepSeek's dualpipev.py and torchtitan run it).

DualPipe feeds microbatches in from both ends at once, so every rank always has a forward of one
direction and a backward of the other to run together as one "F&B" slot, whose communication
(activations one way, gradients the other) hides behind the other's computation. DualPipeV folds
its two model copies into one V (`placement.v_shape`: rank s holds pieces s and 2p-1-s of 2p): the
same slots on p ranks and one copy of the parameters. With PP = 2p pieces (F, B, W per piece) the
bubble is (PP/2 - 1)(F&B + B - 3W) against 1F1B's (PP-1)(F + B) (`dualpipe_v_bubble_formula`).

`dualpipe_v(p, m)` is dualpipev.py's `step` order, step for step (m >= 2p): each rank's phases
nF0, nF0F1, nB1W1F1 (split backward), the main nF0B1F1B0 of F&B slots, nB1F1B0, nB1B0 (the second
half split), nWB0, nW. Every call there is one slot here; an F&B slot is
`[Forward(i, c0), Backward(j, c1)]`. minidist runs a slot's two computations one after the other:
what overlaps is the messages, both receives posted before the slot and both sends after it
(`with_messages`). Deadlock-free with the runtime's background sends (`buffered_sends`), as
DualPipe's batched isend/irecv are. Chapter 5 says what F&B costs on CPU ranks and why full
(two-copy) DualPipe is not here.
"""

from __future__ import annotations

from minidist.parallel.pipeline.instructions import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    OptimizerStep,
    check_sizes,
    with_messages,
)
from minidist.parallel.pipeline.placement import Schedule, v_shape
from minidist.parallel.pipeline.zero_bubble import check_min


def dualpipe_v_min_microbatches(num_stages: int) -> int:
    return 2 * num_stages


def dualpipe_v_bubble_formula(num_stages: int, num_microbatches: int, overlap: float = 0.0) -> float:
    """Bubble fraction from DualPipe's (PP/2-1)(F&B + B - 3W), PP = 2p pieces, per piece F = W = 1/2,
    B = 1 (a stage forward is 1): F&B = (F + B)(1 - overlap), 0 = run one after the other (CPU ranks).
    Each rank works 2m pieces x (F + B) = 3m."""
    p, m = num_stages, num_microbatches
    f, b, w = 0.5, 1.0, 0.5
    bubble = (p - 1) * ((f + b) * (1 - overlap) + b - 3 * w)
    return bubble / (3 * m + bubble)


class _Rank:
    """One rank's slots as dualpipev.py's step builds them: counters per chunk, a FIFO of W's."""

    def __init__(self):
        self.nf, self.nb, self.weights, self.slots = [0, 0], [0, 0], [], []

    def f(self, c):
        self.nf[c] += 1
        return Forward(self.nf[c] - 1, c)

    def b(self, c, split=False):
        self.nb[c] += 1
        mb = self.nb[c] - 1
        if split:
            self.weights.append(BackwardWeight(mb, c))
            return BackwardInput(mb, c)
        return Backward(mb, c)

    def add(self, *ops):
        self.slots.append(list(ops))

    def w(self):
        self.add(self.weights.pop(0))


def _rank_slots(rank: int, p: int, m: int) -> list:
    r, last = _Rank(), rank == p - 1
    for _ in range((p - rank - 1) * 2):          # 1: nF0
        r.add(r.f(0))
    for _ in range(rank + 1):                    # 2: nF0F1
        r.add(r.f(0))
        r.add(r.f(1))
    for _ in range(p - rank - 1):                # 3: nB1W1F1, split backward
        r.add(r.b(1, split=True))
        r.w()
        r.add(r.f(1))
    for i in range(m - 2 * p + rank + 1):        # 4: nF0B1F1B0, the F&B slots
        if i == 0 and last:                      # the turn: no overlap (dualpipev.py's NOTE)
            r.add(r.f(0))
            r.add(r.b(1))
        else:
            r.add(r.f(0), r.b(1))
        r.add(r.f(1), r.b(0))
    for _ in range(p - rank - 1):                # 5: nB1F1B0
        r.add(r.b(1))
        r.add(r.f(1), r.b(0))
    split = False
    for i in range(rank + 1):                    # 6: nB1B0, the second half split
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        r.add(r.b(1, split))
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        r.add(r.b(0, split))
    for _ in range(p - rank - 1):                # 7: nWB0
        r.w()
        r.add(r.b(0, split=True))
    for _ in range(rank + 1):                    # 8: nW
        r.w()
    assert not r.weights and r.nf == [m, m] and r.nb == [m, m], (rank, r.nf, r.nb)
    return r.slots


def dualpipe_v(num_stages: int, num_microbatches: int) -> list[list]:
    """DualPipeV's instruction lists on the V placement (see the module docstring); m >= 2p."""
    check_sizes(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    check_min("dualpipe_v", p, m, dualpipe_v_min_microbatches(p))
    placement = v_shape(p)
    return Schedule([with_messages(_rank_slots(s, p, m), s, placement) + [OptimizerStep()]
                     for s in range(p)], placement, buffered_sends=True)
