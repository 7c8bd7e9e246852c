"""Pipeline schedules as data: per stage, the list of instructions it executes, in order.

A schedule is `list[list[Instr]]`: `schedule[stage]` is what that stage does, one instruction at
a time. The same lists are executed by the stage runtime, simulated without communication
(`minidist.parallel.pipeline.simulate`), checked for deadlock freedom and drawn as timelines.

Instructions name a microbatch `mb` and a model `chunk` (always 0 except where a stage holds
several: interleaved 1F1B's chunk c of stage s is virtual stage c*p + s, ZB-V's chunks are virtual
stages s and 2p-1-s; `minidist.parallel.pipeline.placement` declares which, and a `Schedule` carries
its placement). Sends and receives are BLOCKING with rendezvous semantics: a send completes only
when the matching receive is posted. The peer of a send/receive is implied by the position:
activations flow to virtual stage + 1, gradients to virtual stage - 1 (`peer_of`, `message_key`);
where both virtual stages are on one rank (the turn of a V) the message is a local hand-off.

`SendRecv(ops)` posts several sends/receives at once and completes when all have matched, like
MPI_Sendrecv or Megatron's batched `send_forward_recv_backward`. GPipe and 1F1B do not need it (a
careful order of plain sends and receives is deadlock-free); interleaved 1F1B, whose last stage
sends back to stage 0, uses it after every forward, or forward-and-backward pair.

A backward may also run split in two (zero-bubble schedules, `minidist.parallel.pipeline.zero_bubble`):
`BackwardInput` (B: the input's gradient, which `SendGrad` sends) and later `BackwardWeight` (W: the
weight gradients). A stage runs each (mb, chunk) either as one `Backward` or as B then W.
"""

from __future__ import annotations

from dataclasses import dataclass

from minidist.parallel.pipeline.placement import Placement, Schedule, looped


@dataclass(frozen=True)
class Forward:
    """Run the forward of microbatch `mb` through model chunk `chunk`; keep its activations."""
    mb: int
    chunk: int = 0


@dataclass(frozen=True)
class Backward:
    """Run the backward of microbatch `mb` through `chunk`; frees its activations, accumulates grads."""
    mb: int
    chunk: int = 0


@dataclass(frozen=True)
class BackwardInput:
    """B of a split backward: only the gradient w.r.t. the input of (mb, chunk), on the critical path;
    what the weight gradients need is kept for the matching BackwardWeight."""
    mb: int
    chunk: int = 0


@dataclass(frozen=True)
class BackwardWeight:
    """W of a split backward: the weight gradients of (mb, chunk); frees what its forward and B kept."""
    mb: int
    chunk: int = 0


@dataclass(frozen=True)
class SendAct:
    """Send the output activation of (mb, chunk) to the next virtual stage."""
    mb: int
    chunk: int = 0


@dataclass(frozen=True)
class RecvAct:
    """Receive the input activation of (mb, chunk) from the previous virtual stage."""
    mb: int
    chunk: int = 0


@dataclass(frozen=True)
class SendGrad:
    """Send the gradient w.r.t. the input of (mb, chunk) to the previous virtual stage."""
    mb: int
    chunk: int = 0


@dataclass(frozen=True)
class RecvGrad:
    """Receive the gradient w.r.t. the output of (mb, chunk) from the next virtual stage."""
    mb: int
    chunk: int = 0


@dataclass(frozen=True)
class SendRecv:
    """Post all `ops` (sends and receives) at once; done when every one has matched."""
    ops: tuple


@dataclass(frozen=True)
class OptimizerStep:
    """Update this stage's parameters with the accumulated gradients (end of the step)."""


Instr = (Forward | Backward | BackwardInput | BackwardWeight | SendAct | RecvAct | SendGrad | RecvGrad
         | SendRecv | OptimizerStep)
COMPUTE = (Forward, Backward, BackwardInput, BackwardWeight)
P2P = (SendAct, RecvAct, SendGrad, RecvGrad)


class ScheduleError(ValueError):
    """A schedule (or a request for one) that cannot work, with what would be right."""


def _check(num_stages: int, num_microbatches: int) -> None:
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ScheduleError(f"num_stages must be an int >= 1, got {num_stages!r}")
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ScheduleError(f"num_microbatches must be an int >= 1, got {num_microbatches!r}")


def _placement(where) -> Placement:
    return where if isinstance(where, Placement) else looped(where)


def virtual_stage(stage: int, chunk: int, where) -> int:
    """Position of (stage, chunk) in the model, by `where`: a `Placement`, or a number of stages
    (looped: chunk c of stage s holds virtual stage c*p + s)."""
    return _placement(where).virtual_stage(stage, chunk)


def message_key(instr, stage: int, where) -> tuple:
    """What a send/receive carries: (kind, mb, from virtual stage, to virtual stage). Equal keys match."""
    vs = virtual_stage(stage, instr.chunk, where)
    if isinstance(instr, SendAct):
        return ("act", instr.mb, vs, vs + 1)
    if isinstance(instr, RecvAct):
        return ("act", instr.mb, vs - 1, vs)
    if isinstance(instr, SendGrad):
        return ("grad", instr.mb, vs, vs - 1)
    if isinstance(instr, RecvGrad):
        return ("grad", instr.mb, vs + 1, vs)
    raise TypeError(f"{instr!r} is not a point-to-point instruction")


def peer_of(instr, stage: int, where) -> int:
    """The stage on the other end of a send/receive (the runtime's `dest` or `source`; itself at the
    turn of a V)."""
    _, _, src, dst = message_key(instr, stage, where)
    other = dst if isinstance(instr, (SendAct, SendGrad)) else src
    return _placement(where).rank_of(other)


def _forward(stage: int, p: int, mb: int) -> list:
    """Receive, compute, send: one microbatch's forward on a (non-interleaved) stage."""
    return ([RecvAct(mb)] if stage > 0 else []) + [Forward(mb)] + ([SendAct(mb)] if stage < p - 1 else [])


def _backward(stage: int, p: int, mb: int) -> list:
    return ([RecvGrad(mb)] if stage < p - 1 else []) + [Backward(mb)] + ([SendGrad(mb)] if stage > 0 else [])


def gpipe(num_stages: int, num_microbatches: int) -> list[list]:
    """GPipe: every stage runs all m forwards, then all m backwards, then the optimizer step.

    Peak activations held per stage: m. Deadlock-free with blocking sends: data flows one way at a time.
    """
    _check(num_stages, num_microbatches)
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
    _check(num_stages, num_microbatches)
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


def with_messages(slots: list, stage: int, placement: Placement) -> list:
    """Insert communication around groups ("slots") of compute ops, as Megatron-LM does: after each
    slot, one SendRecv posts every output send of this slot and every input receive of the next.
    Forward receives an activation and sends one on; Backward and BackwardInput (B) receive and send
    gradients; BackwardWeight (W) talks to nobody. Nothing leaves the first or last virtual stage."""
    last_vs = placement.num_virtual - 1

    def recv_for(op):
        vs = placement.virtual_stage(stage, op.chunk)
        if isinstance(op, Forward):
            return RecvAct(op.mb, op.chunk) if vs > 0 else None
        if isinstance(op, (Backward, BackwardInput)):
            return RecvGrad(op.mb, op.chunk) if vs < last_vs else None
        return None

    def send_for(op):
        vs = placement.virtual_stage(stage, op.chunk)
        if isinstance(op, Forward):
            return SendAct(op.mb, op.chunk) if vs < last_vs else None
        if isinstance(op, (Backward, BackwardInput)):
            return SendGrad(op.mb, op.chunk) if vs > 0 else None
        return None

    def exchange(parts):
        parts = tuple(x for x in parts if x is not None)
        return [] if not parts else [parts[0]] if len(parts) == 1 else [SendRecv(parts)]

    ops = exchange(recv_for(op) for op in slots[0])
    for k, slot in enumerate(slots):
        ops += slot
        following = slots[k + 1] if k + 1 < len(slots) else []
        ops += exchange([send_for(op) for op in slot] + [recv_for(op) for op in following])
    return ops


def interleaved_1f1b(num_stages: int, num_microbatches: int, chunks: int) -> list[list]:
    """Interleaved 1F1B (Megatron-LM): each stage holds `chunks` model chunks (virtual stages).

    Bubble shrinks to (p-1)/(v*m + p-1). Needs p >= 2 and m a multiple of p, as Megatron does.
    """
    _check(num_stages, num_microbatches)
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

