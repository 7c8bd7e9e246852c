"""ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) as data: 1F1B, backward split in two.

A backward is B (the gradient for the stage's input: the previous stage waits for it) and W (the
weight gradients: nobody needs them before the optimizer step). Send B's result on at once and run
W later, and a stage's wait for gradients shrinks to the B chain alone: the W's it has put off fill
the gaps where it would have waited.

`zb_h1_order` is the paper's handcrafted order: stage s runs 1F1B's p - s warm-up forwards, then for
each microbatch j its B, the W of microbatch j - s (put off by s), the next F; then its last s W's.
With F = B = W every stage ends at the floor 3m + p - 1 (chapter 5 has the proof sketch), holding
at most p - s microbatches between F and B (1F1B's peak: the paper's M_B) and s + 1 between B and W
(M_W, their layer inputs and output gradients). Its bubble is (p-1)(F + B - W). Needs m >= p.

Between consecutive compute ops one SendRecv (the send of the op just done, the receive of the
next); W's never block. Deadlock-free under rendezvous, made for the runtime's background sends.
ZB-H2 (`zb_h2.py`) spends twice the memory on a longer warm-up.
"""

from __future__ import annotations

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


def zb_h1_order(p: int, m: int) -> list:
    """Each stage's compute order: p - s forwards; per microbatch j, B_j, then W_{j-s} (s microbatches
    late), then the next F; at the end the s W's still put off."""
    order = []
    for s in range(p):
        ops = [Forward(i) for i in range(p - s)]
        for j in range(m):
            ops.append(BackwardInput(j))
            if j >= s:
                ops.append(BackwardWeight(j - s))
            if p - s + j < m:
                ops.append(Forward(p - s + j))
        order.append(ops + [BackwardWeight(j) for j in range(m - s, m)])
    return order


def zb_h1(num_stages: int, num_microbatches: int) -> list[list]:
    """ZB-H1's instruction lists (a `Schedule`): see the module docstring."""
    check_sizes(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    check_min("zb_h1", p, m, zb_h1_min_microbatches(p))
    return as_schedule(zb_h1_order(p, m), looped(p))


def as_schedule(order: list, placement: Placement, buffered_sends: bool = True) -> Schedule:
    """Compute orders -> a Schedule: between consecutive compute ops one SendRecv with the send of the
    op just done and the receive of the next (`with_messages`, one op a slot), then the step."""
    return Schedule([with_messages([[op] for op in ops], r, placement) + [OptimizerStep()]
                     for r, ops in enumerate(order)], placement, buffered_sends)


def zb_h1_min_microbatches(num_stages: int) -> int:
    return num_stages


def check_min(name: str, p: int, m: int, least: int) -> None:
    if m < least:
        raise ScheduleError(f"{name} needs num_microbatches >= {least} for num_stages={p}, got {m}: its "
                            f"put-off W's fill the cool-down only with that many in flight; use "
                            f"{least} or more microbatches, or '1f1b'")


def zb_h1_bubble_formula(num_stages: int, num_microbatches: int) -> float:
    """ZB-H1's bubble with F = B = W: only the B chain waits, (p-1) of 3m + p - 1 steps."""
    p, m = num_stages, num_microbatches
    return (p - 1) / (3 * m + p - 1)


def zb_h1_bubble(num_stages: int, F: float, B: float, W: float) -> float:
    """Seconds a ZB-H1 stage idles per step: the paper's (p-1)(F + B - W) where W <= F and W <= B;
    never below the fill's (p-1)F or the B chain's (p-1)B (a W longer than either fills nothing more)."""
    return (num_stages - 1) * max(F + B - W, F, B)
