"""DualPipe and DualPipeV (DeepSeek-V3), as DeepSeek's dualpipe.py and dualpipev.py order them.

DualPipe feeds microbatches in from both ends at once, so every rank always has a forward of one
direction and a backward of the other to run together as one "F&B" slot, whose communication
(activations one way, gradients the other) hides behind the other's computation. DualPipeV folds
its two model copies into one V (`placement.v_shape`: rank s holds pieces s and 2p-1-s of 2p): the
same slots on p ranks and one copy of the parameters.

`dualpipe_v(p, m)` is dualpipev.py's `step` order, step for step (m >= 2p): each rank's phases
nF0, nF0F1, nB1W1F1 (split backward), the main nF0B1F1B0 of F&B slots, nB1F1B0, nB1B0 (the second
half split), nWB0, nW. An F&B slot is `Forward(i, c0)` then `Backward(j, c1)`. minidist runs them one
after the other, each with its own messages: the forward's input is waited for before the forward,
the backward's gradient only before the backward (posting both first would tie the forward to a
gradient it does not need). `dualpipe(p, m)` is the two-copy original (p even, m even >= 2p; the
`dual` placement: each piece on ranks s and p-1-s, the runtime sums their gradients): rank s runs
DualPipeV's order for rank min(s, p-1-s) of p/2, its own direction as chunk 0. Both are made for
the runtime's background sends, as DualPipe's batched isend/irecv are. Chapter 5 has the bubbles.
"""

from __future__ import annotations

from minidist.parallel.pipeline.instructions import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    ScheduleError,
    check_sizes,
)
from minidist.parallel.pipeline.placement import dual, v_shape
from minidist.parallel.pipeline.zero_bubble import as_schedule, check_min


def dualpipe_v_min_microbatches(num_stages: int) -> int:
    return 2 * num_stages


def dualpipe_v_bubble_formula(num_stages: int, num_microbatches: int, overlap: float = 0.0) -> float:
    """Bubble fraction from DualPipe's (PP/2-1)(F&B + B - 3W), PP = 2p pieces, per piece F = W = 1/2,
    B = 1 (a stage forward is 1): F&B = (F + B)(1 - overlap), 0 = run one after the other (CPU ranks).
    Each rank works 2m pieces x (F + B) = 3m."""
    return dualpipe_bubble_formula(2 * num_stages, num_microbatches, 0.5, 1.0, 0.5, overlap, work=3.0)


def dualpipe_bubble_formula(num_stages: int, num_microbatches: int, F: float = 1.0, B: float = 2.0,
                            W: float = 1.0, overlap: float = 0.0, work: float | None = None) -> float:
    """DeepSeek's DualPipe bubble (PP/2 - 1)(F&B + B - 3W), PP = `num_stages` pieces (a full backward
    B, F&B = (F + B)(1 - overlap)), as a fraction of a rank's step: every rank runs each of the m
    microbatches through one piece, `work` = m(F + B) by default."""
    p, m = num_stages, num_microbatches
    bubble = (p / 2 - 1) * ((F + B) * (1 - overlap) + B - 3 * W)
    work = m * (F + B) if work is None else m * work
    return bubble / (work + bubble)


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
    return as_schedule([_flat(slots) for slots in dualpipe_v_slots(p, m)], v_shape(p))


def dualpipe_v_slots(p: int, m: int) -> list:
    """Each rank's slots as dualpipev.py's `step` makes them (an F&B slot: [Forward, Backward])."""
    return [_rank_slots(s, p, m) for s in range(p)]


def dualpipe(num_stages: int, num_microbatches: int) -> list[list]:
    """Full DualPipe on the dual placement (two copies; see the module docstring): microbatches
    0..m/2-1 enter at rank 0 through copy 0 (chunk 0), m/2..m-1 at rank p-1 through copy 1."""
    check_sizes(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    if p % 2 or m % 2:
        raise ScheduleError(f"dualpipe needs an even num_stages and num_microbatches (half enter at each "
                            f"end), got {p} and {m}; use {p + p % 2} stages, {m + m % 2} microbatches")
    check_min("dualpipe", p, m, dualpipe_min_microbatches(p))
    return as_schedule([_flat(slots) for slots in dualpipe_slots(p, m)], dual(p))


def dualpipe_slots(p: int, m: int) -> list:
    """Rank s's slots: DualPipeV's for rank min(s, p-1-s) of p/2 ranks and m/2 microbatches, whose chunk
    0 (its own direction) is copy 0 on the first half of the ranks, copy 1 on the second."""
    out = []
    for s in range(p):
        flip = int(s >= p // 2)
        out.append([[type(op)(op.mb + (op.chunk ^ flip) * (m // 2), op.chunk ^ flip) for op in slot]
                    for slot in _rank_slots(min(s, p - 1 - s), p // 2, m // 2)])
    return out


def dualpipe_min_microbatches(num_stages: int) -> int:
    return 2 * num_stages


def _flat(slots) -> list:
    return [op for slot in slots for op in slot]
