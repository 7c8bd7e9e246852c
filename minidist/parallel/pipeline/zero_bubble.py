"""Zero-bubble pipeline schedules (Qi et al., ICLR 2024) as data: 1F1B with each backward split in two.

A backward is B (the gradient for the stage's input: the previous stage waits for it) and W (the
weight gradients: nobody needs them before the optimizer step). Send B's result on at once and run
W later, and a stage's wait for gradients shrinks to the B chain alone: the W's it has put off fill
the gaps where it would have waited.

Both orders are what a greedy list scheduler picks in unit steps (`greedy_order`, also used by ZB-V):
B as soon as its gradient is here, else F within the in-flight limits, else the oldest put-off W.

* `zb_h1(p, m)`: 1F1B's limits (p - s in flight on stage s, at most p held from F to W: 1F1B's
  peak memory); bubble about (p-1)/(3m+p-1), a third of 1F1B's when m >> p. Needs m >= p.
* `zb_h2(p, m)`: 2(p - s) - 1 in flight on stage s (2p - 1 held, about twice 1F1B's memory); its
  put-off W's fill the whole cool-down: exactly the floor 3m + p - 1. Needs m >= 2p - 1.

Between consecutive compute ops one SendRecv (the send of the op just done, the receive of the
next); W's never block. Made for the runtime's background sends (`Schedule.buffered_sends`).
Chapter 5 (lessons/05-pipeline.md) derives the floor and gives the measured numbers.
"""

from __future__ import annotations

import functools

from minidist.parallel.pipeline.instructions import (
    BackwardInput,
    BackwardWeight,
    Forward,
    OptimizerStep,
    ScheduleError,
    check_sizes,
    with_messages,
)
from minidist.parallel.pipeline.placement import Placement, Schedule, looped


def zb_h1_min_microbatches(num_stages: int) -> int:
    return num_stages


def zb_h2_min_microbatches(num_stages: int) -> int:
    return 2 * num_stages - 1


def zb_h1_bubble_formula(num_stages: int, num_microbatches: int) -> float:
    """ZB-H1's ideal bubble with F = B = W: only the B chain waits, (p-1) of 3m + p - 1 steps."""
    p, m = num_stages, num_microbatches
    return (p - 1) / (3 * m + p - 1)


def zb_h2_bubble_formula(num_stages: int, num_microbatches: int) -> float:
    """ZB-H2's bubble with F = B = W in the rectangle (one synchronised step): the bound (p-1)/(3m+p-1);
    over each stage's own interval (the paper's parallelogram) it is (p-1)(F + B - 2W) = 0."""
    return zb_h1_bubble_formula(num_stages, num_microbatches)


def check_min(name: str, p: int, m: int, least: int) -> None:
    if m < least:
        raise ScheduleError(f"{name} needs num_microbatches >= {least} for num_stages={p}, got {m}: its "
                            f"put-off W's fill the cool-down only with that many in flight; use "
                            f"{least} or more microbatches, or '1f1b'")


def greedy_order(placement: Placement, m: int, in_flight, held: int, w_first_at_cap=()) -> list:
    """Each rank's compute order when, in unit time steps (F = B = W = 1, results usable the next
    step), every idle rank takes the first of: a B whose gradient is here (the latest virtual stage
    first: it has the longest chain still to run); an F whose input is here, the latest virtual
    stage first, if fewer than `in_flight(rank, chunk)` of that chunk are between F and B and fewer
    than `held` of the rank's microbatch-chunks between F and W; else the oldest put-off W. A rank
    in `w_first_at_cap` that holds `held` runs a put-off W before any B (freeing room for an F).

    Microbatches enter each chunk in order 0..m-1. Raises ScheduleError if the limits starve it."""
    p, v, last = placement.num_stages, placement.chunks, placement.num_virtual - 1
    vs_of = [[placement.virtual_stage(r, c) for c in range(v)] for r in range(p)]
    by_lateness = [sorted(range(v), key=lambda c, r=r: -vs_of[r][c]) for r in range(p)]
    ready = {("F", 0, mb): 0 for mb in range(m)}  # (kind, virtual stage, mb) -> step its input is here
    nf, nb = [[0] * v for _ in range(p)], [[0] * v for _ in range(p)]
    put_off, holding = [[] for _ in range(p)], [0] * p
    order = [[] for _ in range(p)]
    t, never, idle = 0, float("inf"), 0
    while any(put_off[r] or any(nb[r][c] < m for c in range(v)) for r in range(p)):
        moved = False
        for r in range(p):
            op = None
            if r in w_first_at_cap and holding[r] >= held and put_off[r]:
                b = put_off[r].pop(0)
                op = BackwardWeight(b.mb, b.chunk)
                holding[r] -= 1
            for c in by_lateness[r] if op is None else ():
                vs, j = vs_of[r][c], nb[r][c]
                if j < nf[r][c] and ready.get(("B", vs, j), never) <= t:
                    op = BackwardInput(j, c)
                    nb[r][c] += 1
                    put_off[r].append(op)
                    ready[("B", vs - 1, j)] = t + 1
                    break
            for c in by_lateness[r] if op is None else ():
                vs, i = vs_of[r][c], nf[r][c]
                if i < m and ready.get(("F", vs, i), never) <= t and i - nb[r][c] < in_flight(r, c) \
                        and holding[r] < held:
                    op = Forward(i, c)
                    nf[r][c] += 1
                    holding[r] += 1
                    ready[("B", vs, i) if vs == last else ("F", vs + 1, i)] = t + 1
                    break
            if op is None and put_off[r]:
                b = put_off[r].pop(0)
                op = BackwardWeight(b.mb, b.chunk)
                holding[r] -= 1
            if op is not None:
                order[r].append(op)
                moved = True
        idle = 0 if moved else idle + 1
        if idle > 2:
            raise ScheduleError(f"the greedy order starves with these in-flight limits and held={held} "
                                f"(p={p}, m={m}); raise the limits")
        t += 1
    return order


def as_schedule(order: list, placement: Placement, buffered_sends: bool = True) -> Schedule:
    """Compute orders -> a Schedule: between consecutive compute ops one SendRecv with the send of the
    op just done and the receive of the next (`with_messages`, one op a slot), then the step. The
    orders were made for messages that arrive the next step whoever waits: background sends."""
    return Schedule([with_messages([[op] for op in ops], r, placement) + [OptimizerStep()]
                     for r, ops in enumerate(order)], placement, buffered_sends)


def zb_h1(num_stages: int, num_microbatches: int) -> list[list]:
    """ZB-H1 (see the module docstring): 1F1B's in-flight limit p - s, a third of its bubble."""
    check_sizes(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    check_min("zb_h1", p, m, zb_h1_min_microbatches(p))
    return as_schedule(_zb_h1_order(p, m, _zb_h1_best_k(p, m)), looped(p))


def _zb_h1_order(p: int, m: int, k: int) -> list:
    return greedy_order(looped(p), m, lambda s, c: p - s, held=p, w_first_at_cap=range(p - k, p))


@functools.cache
def _zb_h1_best_k(p: int, m: int) -> int:
    """The k for which "W first at the cap" on the last k stages (k = 0: the plain rule) gives the
    shortest step with F = B = W: a ZB-H1 at most one step above the floor for p = 2..8."""
    return min(range(p), key=lambda k: unit_makespan(_zb_h1_order(p, m, k), looped(p)))


def unit_makespan(order: list, placement: Placement) -> int:
    """The step's length when every rank runs its compute `order` as early as its inputs allow, with
    F = B = W = 1 and free messages: what `simulate` gives `as_schedule(order, placement)`."""
    last = placement.num_virtual - 1
    end, clock, pc = {}, [0] * len(order), [0] * len(order)
    moved = True
    while moved:
        moved = False
        for r, ops in enumerate(order):
            while pc[r] < len(ops):
                op = ops[pc[r]]
                vs = placement.virtual_stage(r, op.chunk)
                forward = isinstance(op, Forward)
                dep = ("F", vs - 1, op.mb) if forward and vs > 0 else \
                    ("B", vs + 1, op.mb) if isinstance(op, BackwardInput) and vs < last else None
                if dep is not None and dep not in end:
                    break  # its input comes from another rank that has not computed it yet
                clock[r] = max(clock[r], end.get(dep, 0)) + 1
                if not isinstance(op, BackwardWeight):
                    end[("F" if forward else "B", vs, op.mb)] = clock[r]
                pc[r] += 1
                moved = True
    if any(pc[r] < len(ops) for r, ops in enumerate(order)):
        raise ScheduleError(f"the order deadlocks (p={placement.num_stages})")
    return max(clock)


def zb_h2(num_stages: int, num_microbatches: int) -> list[list]:
    """ZB-H2 (see the module docstring): 2(p - s) - 1 in flight on stage s, bubble at its bound."""
    check_sizes(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    check_min("zb_h2", p, m, zb_h2_min_microbatches(p))
    return as_schedule(greedy_order(looped(p), m, lambda s, c: 2 * (p - s) - 1, held=2 * p - 1), looped(p))
