"""What a pipeline stage executes: the instructions of a schedule, and who each message goes to.

A schedule is `list[list[Instr]]`: `schedule[stage]` is what that stage does, in order. Each
instruction names a microbatch `mb` and a model `chunk` (0 unless a stage holds several; the
schedule's `Placement` says which virtual stage a chunk is). Activations flow to virtual stage + 1,
gradients to virtual stage - 1, so the peer of a send or receive follows from its position
(`message_key`, `peer_of`); where both ends are on one rank (the turn of a V) it is a local hand-off.
`SendRecv(ops)` posts several at once and completes when all have matched (MPI_Sendrecv, Megatron's
batched `send_forward_recv_backward`). A backward may run whole (`Backward`) or split in two for the
zero-bubble schedules: `BackwardInput` (B, the input's gradient) and later `BackwardWeight` (W).
"""

from __future__ import annotations

from dataclasses import dataclass

from minidist.parallel.pipeline.placement import Placement, looped


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


def check_sizes(num_stages: int, num_microbatches: int) -> None:
    """What every schedule builder checks first: both counts are ints >= 1."""
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
    return _placement(where).rank_of(other, instr.chunk)


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
