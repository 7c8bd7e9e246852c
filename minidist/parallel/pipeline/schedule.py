"""GPipe, 1F1B and interleaved 1F1B as data: per stage, the list of instructions it executes.

The instructions are `instructions.py`'s (re-exported here). The same lists are executed by the
runtime (`runtime.py`), simulated without communication (`simulate.py`), checked for deadlock
freedom and drawn as timelines. Sends and receives block with rendezvous semantics, so each order
below is deadlock-free by construction: GPipe and 1F1B by a careful order of plain sends and
receives; interleaved 1F1B, whose last stage sends back to stage 0, by a `SendRecv` after each slot.
"""

from __future__ import annotations

from minidist.parallel.pipeline.instructions import (
    COMPUTE,
    Backward,
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
    check_sizes,
    message_key,
    peer_of,
    with_messages,
)
from minidist.parallel.pipeline.placement import Schedule, looped

__all__ = ["COMPUTE", "Backward", "BackwardInput", "BackwardWeight", "Forward", "OptimizerStep", "RecvAct",
           "RecvGrad", "ScheduleError", "SendAct", "SendGrad", "SendRecv", "gpipe", "interleaved_1f1b",
           "interleaved_warmup", "message_key", "one_f_one_b", "peer_of"]


def _forward(stage: int, p: int, mb: int) -> list:
    """Receive, compute, send: one microbatch's forward on a (non-interleaved) stage."""
    return ([RecvAct(mb)] if stage > 0 else []) + [Forward(mb)] + ([SendAct(mb)] if stage < p - 1 else [])


def _backward(stage: int, p: int, mb: int) -> list:
    return ([RecvGrad(mb)] if stage < p - 1 else []) + [Backward(mb)] + ([SendGrad(mb)] if stage > 0 else [])


def gpipe(num_stages: int, num_microbatches: int) -> list[list]:
    """GPipe: every stage runs all m forwards, then all m backwards, then the optimizer step.

    Peak activations held per stage: m. Deadlock-free with blocking sends: data flows one way at a time.
    """
    check_sizes(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    schedule = []
    for s in range(p):
        ops = [op for i in range(m) for op in _forward(s, p, i)]
        ops += [op for i in range(m) for op in _backward(s, p, i)]
        schedule.append(ops + [OptimizerStep()])
    return Schedule(schedule, looped(p))


def one_f_one_b(num_stages: int, num_microbatches: int) -> list[list]:
    """1F1B (PipeDream-Flush): warm up with p-1-s forwards, then alternate one forward, one backward.

    Stage s holds at most min(m, p - s) microbatches' activations (GPipe: m). Same bubble as GPipe.

    Deadlock freedom with blocking sends: in the steady state stage s does `SendAct(i); RecvGrad(j)`
    towards stage s+1, so stage s+1 must do the mirror order `RecvAct(i); SendGrad(j)`: after each
    backward a stage first receives its next forward's input, then sends the gradient back.
    (Sending the gradient first would deadlock: both neighbours would be sending.)
    """
    check_sizes(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    first, last = 0, p - 1
    schedule = []
    for s in range(p):
        warmup = min(p - 1 - s, m)
        steady = m - warmup
        ops = [op for i in range(warmup) for op in _forward(s, p, i)]
        if steady > 0 and s != first:
            ops.append(RecvAct(warmup))
        for j in range(steady):
            i = warmup + j  # forward mb i, then backward mb j
            ops.append(Forward(i))
            if s != last:
                ops += [SendAct(i), RecvGrad(j)]
            ops.append(Backward(j))
            if j + 1 < steady and s != first:
                ops.append(RecvAct(i + 1))  # before SendGrad(j): the mirror of the upstream stage's order
            if s != first:
                ops.append(SendGrad(j))
        ops += [op for j in range(steady, m) for op in _backward(s, p, j)]
        schedule.append(ops + [OptimizerStep()])
    return Schedule(schedule, looped(p))


def interleaved_warmup(num_stages: int, num_microbatches: int, chunks: int, stage: int) -> int:
    """Forwards stage `stage` runs before its first backward in interleaved 1F1B (Megatron-LM's count)."""
    total = num_microbatches * chunks
    if num_microbatches == num_stages:
        return total
    return min((num_stages - stage - 1) * 2 + (chunks - 1) * num_stages, total)


def _interleaved_op(k: int, p: int, v: int, forward: bool):
    """The k-th forward (or backward) of a stage: microbatches go in groups of p through chunk after chunk."""
    group, within = divmod(k, p * v)
    chunk = within // p
    mb = group * p + within % p
    return Forward(mb, chunk) if forward else Backward(mb, v - 1 - chunk)


def interleaved_1f1b(num_stages: int, num_microbatches: int, chunks: int) -> list[list]:
    """Interleaved 1F1B (Megatron-LM): each stage holds `chunks` model chunks (virtual stages).

    Bubble shrinks to (p-1)/(v*m + p-1). Needs p >= 2 and m a multiple of p, as Megatron does.
    """
    check_sizes(num_stages, num_microbatches)
    p, m, v = num_stages, num_microbatches, chunks
    if not isinstance(v, int) or v < 1:
        raise ScheduleError(f"chunks must be an int >= 1, got {v!r}")
    if p < 2:
        raise ScheduleError("interleaved_1f1b needs num_stages >= 2; for one stage use one_f_one_b(1, m)")
    if m % p != 0:
        lower = m - m % p
        raise ScheduleError(
            f"interleaved_1f1b needs num_microbatches to be a multiple of num_stages={p}, got {m}; "
            + (f"use {lower} or {lower + p} microbatches" if lower >= p else
               f"use {p} microbatches (or another multiple of {p})"))
    total = m * v
    schedule, placement = [], looped(p, v)
    for s in range(p):
        warmup = interleaved_warmup(p, m, v, s)
        slots = [[_interleaved_op(k, p, v, True)] for k in range(warmup)]
        for k in range(total - warmup):  # steady state: one forward and one backward per slot
            slots.append([_interleaved_op(warmup + k, p, v, True), _interleaved_op(k, p, v, False)])
        slots += [[_interleaved_op(k, p, v, False)] for k in range(total - warmup, total)]
        schedule.append(with_messages(slots, s, placement) + [OptimizerStep()])
    return Schedule(schedule, placement)

