"""A list scheduler in unit steps, and the step an order takes: for orders not (yet) handcrafted.

`greedy_order` is what an idle rank picks when F = B = W = 1 and results are usable the next step: B
first, else F within in-flight limits and a memory cap, else the oldest put-off W. ZB-V uses it below
2p - 1 microbatches (its handcrafted order needs that many); the tests use `unit_makespan` to time
any compute order as the simulator would, without building its messages.
"""

from __future__ import annotations

from minidist.parallel.pipeline.instructions import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    ScheduleError,
)
from minidist.parallel.pipeline.placement import Placement


def greedy_order(placement: Placement, m: int, in_flight, held: int) -> list:
    """Each rank's compute order when, in unit time steps (F = B = W = 1, results usable the next
    step), every idle rank takes the first of: a B whose gradient is here (the latest virtual stage
    first: it has the longest chain still to run); an F whose input is here, the latest virtual
    stage first, if fewer than `in_flight(rank, chunk)` of that chunk are between F and B and fewer
    than `held` of the rank's microbatch-chunks between F and W; else the oldest put-off W.

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
            for c in by_lateness[r]:
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


def unit_makespan(order: list, placement: Placement) -> int:
    """The step's length when every rank runs its compute `order` as early as its inputs allow, with
    F = B = W = 1 (a whole Backward 2) and free messages: what `simulate` gives
    `as_schedule(order, placement)` with background sends."""
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
                    ("B", vs + 1, op.mb) if isinstance(op, (BackwardInput, Backward)) and vs < last else None
                if dep is not None and dep not in end:
                    break  # its input comes from another rank that has not computed it yet
                clock[r] = max(clock[r], end.get(dep, 0)) + 1 + isinstance(op, Backward)
                if not isinstance(op, BackwardWeight):
                    end[("F" if forward else "B", vs, op.mb)] = clock[r]
                pc[r] += 1
                moved = True
    if any(pc[r] < len(ops) for r, ops in enumerate(order)):
        raise ScheduleError(f"the order deadlocks (p={placement.num_stages})")
    return max(clock)
