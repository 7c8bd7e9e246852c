"""Zero-bubble pipeline schedules (Qi et al., ICLR 2024) as data: 1F1B with each backward split in two.

A backward is B (the gradient for the stage's input: the previous stage waits for it) and W (the
weight gradients: nobody waits for them until the optimizer step). 1F1B's bubble is the time a
stage waits for gradients to come back down the pipeline, (p-1)(F + B + W) per stage. Send B on at
once and do W later, and the wait shrinks to the B chain alone: the W's a stage has put off fill
the gaps where it would have waited.

* `zb_h1(p, m)`: the order a greedy list scheduler picks in unit steps (`_greedy_order`): B as
  soon as its gradient is here, else F within 1F1B's limits (p - s microbatches between F and B on
  stage s, and no stage holding more than p from F to W: 1F1B's peak, on stage 0), else the oldest
  put-off W. With F = B = W the ideal is a makespan of 3m + p - 1, bubble (p-1)/(3m + p-1): a third
  of 1F1B's (p-1)/(m+p-1) when m >> p; the memory bound costs at most 2 steps more. Needs m >= p.

Communication follows 1F1B's deadlock-free order (each stage mirrors its neighbour's
send/receive order); W's are pure compute and never block.
"""

from __future__ import annotations

from minidist.parallel.pipeline.schedule import (
    BackwardInput,
    BackwardWeight,
    Forward,
    OptimizerStep,
    RecvAct,
    RecvGrad,
    ScheduleError,
    SendAct,
    SendGrad,
    SendRecv,
    _check,
)


def zb_h1_min_microbatches(num_stages: int) -> int:
    return num_stages


def zb_h1_bubble_formula(num_stages: int, num_microbatches: int) -> float:
    """ZB-H1's ideal bubble with F = B = W: only the B chain waits, (p-1) of 3m + p - 1 steps."""
    p, m = num_stages, num_microbatches
    return (p - 1) / (3 * m + p - 1)


def _check_min(name: str, p: int, m: int, least: int) -> None:
    if m < least:
        raise ScheduleError(f"{name} needs num_microbatches >= {least} for num_stages={p}, got {m}: its "
                            f"put-off W's fill the cool-down only with that many in flight; use "
                            f"{least} or more microbatches, or '1f1b'")


def _greedy_order(p: int, m: int, limit: list, held: int) -> list:
    """Each stage's compute order when, in unit time steps (F = B = W = 1, messages arrive the next
    step), every idle stage takes the first of: B of its oldest microbatch whose gradient is here;
    F of its next microbatch if the input is here, fewer than `limit[s]` are between F and B and
    fewer than `held` between F and W; the oldest put-off W. Stops when every W has run."""
    act = [dict.fromkeys(range(m), 0)] + [{} for _ in range(p - 1)]  # mb -> step its input is here
    grad = [{} for _ in range(p)]
    nf, nb, nw, put_off = [0] * p, [0] * p, [0] * p, [[] for _ in range(p)]
    order = [[] for _ in range(p)]
    t, never = 0, float("inf")
    while any(nb[s] < m or put_off[s] for s in range(p)):
        for s in range(p):
            if nb[s] < nf[s] and grad[s].get(nb[s], never) <= t:
                j = nb[s]
                nb[s] += 1
                order[s].append(BackwardInput(j))
                put_off[s].append(j)
                if s > 0:
                    grad[s - 1][j] = t + 1
            elif nf[s] < m and act[s].get(nf[s], never) <= t and nf[s] - nb[s] < limit[s] \
                    and nf[s] - nw[s] < held:
                i = nf[s]
                nf[s] += 1
                order[s].append(Forward(i))
                (act[s + 1] if s < p - 1 else grad[s])[i] = t + 1
            elif put_off[s]:
                order[s].append(BackwardWeight(put_off[s].pop(0)))
                nw[s] += 1
        t += 1
    return order


def _with_messages(order: list, s: int, p: int) -> list:
    """Between consecutive compute ops, one SendRecv: the send of the op just done and the receive of
    the next one (as interleaved 1F1B does): a stage never blocks its neighbour while it waits."""
    def recv_for(op):
        if isinstance(op, Forward) and s > 0:
            return RecvAct(op.mb)
        if isinstance(op, BackwardInput) and s < p - 1:
            return RecvGrad(op.mb)
        return None

    def send_for(op):
        if isinstance(op, Forward) and s < p - 1:
            return SendAct(op.mb)
        if isinstance(op, BackwardInput) and s > 0:
            return SendGrad(op.mb)
        return None

    def exchange(parts):
        parts = tuple(x for x in parts if x is not None)
        return [] if not parts else [parts[0]] if len(parts) == 1 else [SendRecv(parts)]

    ops = exchange([recv_for(order[0])])
    for k, op in enumerate(order):
        ops.append(op)
        ops += exchange([send_for(op), recv_for(order[k + 1]) if k + 1 < len(order) else None])
    return ops


def zb_h1(num_stages: int, num_microbatches: int) -> list[list]:
    """ZB-H1 (see the module docstring): 1F1B's in-flight limit p - s, a third of its bubble."""
    _check(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    _check_min("zb_h1", p, m, zb_h1_min_microbatches(p))
    order = _greedy_order(p, m, [p - s for s in range(p)], held=p)
    return [_with_messages(order[s], s, p) + [OptimizerStep()] for s in range(p)]
