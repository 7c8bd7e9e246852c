"""Run a pipeline schedule in one process without communication: timing, deadlocks, bubble, memory.

`simulate(schedule)` steps all stages' instruction lists together. Compute instructions take
`fwd_time` / `bwd_time` (per model chunk) and `opt_time`. Sends and receives are blocking with
rendezvous semantics: a send and its matching receive (same `message_key`) both complete at
max(the times the two stages posted them) + `comm_time`; a `SendRecv` completes when all its parts
have. A message between two chunks of one stage (the turn of a V placement) is a local hand-off:
it never waits for its receive. If no stage can move, the schedule deadlocks under blocking
point-to-point: `DeadlockError` names every stage's blocked instruction. The result is
deterministic: each match depends only on the two stages' own histories, not on the order the
simulator finds it.

Bubble definition used throughout (`minidist.trace.bubble_fraction`): the idle share of the
rectangle p stages x [0, makespan], where only forward and backward count as busy. With
comm_time = 0, GPipe and 1F1B give exactly (p-1)/(m+p-1) for any fwd_time and bwd_time (every
stage is busy m*(f+b) out of a makespan of (m+p-1)*(f+b)); interleaved 1F1B with v chunks gives
(p-1)/(v*m+p-1) when fwd_time == bwd_time. A split backward's B and W count as busy too: ZB-H1 with
F = B = W gives exactly (p-1)/(3m+p-1) (see `zero_bubble`). With `buffered_sends` a send does not
wait for its receiver, as the runtime's background sends do not.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from minidist.parallel.pipeline.instructions import (
    COMPUTE,
    P2P,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    OptimizerStep,
    ScheduleError,
    SendAct,
    SendGrad,
    SendRecv,
    message_key,
)
from minidist.parallel.pipeline.placement import placement_of
from minidist.trace.timeline import ascii_timeline_from_events, bubble_fraction


class DeadlockError(RuntimeError):
    """No stage can make progress; `blocked` maps each unfinished stage to its blocked instruction."""

    def __init__(self, blocked: dict):
        self.blocked = blocked
        detail = "; ".join(f"stage {s} blocked at {instr!r}" for s, instr in blocked.items())
        super().__init__(f"schedule deadlocks under blocking point-to-point: {detail}")


@dataclass
class SimResult:
    """What a simulated run did: one event dict per instruction (see minidist.trace), and summaries."""
    num_stages: int
    events: list
    makespan: float
    bubble: float
    peak_activations: list
    peak_pending_weights: list


def bubble_formula(num_stages: int, num_microbatches: int, chunks: int = 1) -> float:
    """Textbook bubble fraction (p-1)/(v*m + p-1); v = 1 for GPipe and 1F1B."""
    p, m, v = num_stages, num_microbatches, chunks
    return (p - 1) / (v * m + p - 1)


def simulate(schedule: list[list], fwd_time: float = 1.0, bwd_time: float = 2.0, comm_time: float = 0.0,
             opt_time: float = 0.0, input_time: float | None = None, weight_time: float | None = None,
             buffered_sends: bool | None = None, piece_scale=None, op_time=None) -> SimResult:
    """Execute all stages in lock step (see module docstring); raise DeadlockError if they get stuck.

    A split backward's parts take `input_time` (B) and `weight_time` (W), by default half of
    `bwd_time` each. `buffered_sends`: a send completes when posted and its receive at max(posted,
    sent + comm_time) (in flight from the send on), as the runtime's background sends (`isend`) do;
    None (the default): what the schedule declares it needs (`Schedule.buffered_sends`: True for the
    V schedules, whose two directions on one link cross under rendezvous), else rendezvous.
    `piece_scale` (one number per virtual stage, default all 1): a piece's F, B and W are its number
    times the costs above -- a cut of unequal pieces. `op_time(stage, instr)` (optional): one
    compute instruction's seconds on that stage, e.g. what a run measured (`measured_costs`), in
    place of all of the above."""
    if buffered_sends is None:
        buffered_sends = getattr(schedule, "buffered_sends", False)
    validate(schedule)
    p, placement = len(schedule), placement_of(schedule)
    cost = {Forward: fwd_time, Backward: bwd_time, OptimizerStep: opt_time,
            BackwardInput: bwd_time / 2 if input_time is None else input_time,
            BackwardWeight: bwd_time / 2 if weight_time is None else weight_time}
    scale = [1.0] * placement.num_virtual if piece_scale is None else [float(x) for x in piece_scale]
    if len(scale) != placement.num_virtual:
        raise ValueError(f"piece_scale has {len(scale)} numbers; the schedule's placement has "
                         f"{placement.num_virtual} pieces (one number each)")

    def duration(s, instr):
        if op_time is not None and not isinstance(instr, OptimizerStep):
            return op_time(s, instr)
        t = cost[type(instr)]
        return t if isinstance(instr, OptimizerStep) else t * scale[placement.virtual_stage(s, instr.chunk)]
    pc = [0] * p
    clock = [0.0] * p
    matched: list[dict] = [{} for _ in range(p)]  # part index -> completion time, for the current instr
    events = []
    mailbox: dict = {}  # buffered sends: message key -> time it was sent
    while True:
        progressed = False
        for s in range(p):  # compute never blocks
            while pc[s] < len(schedule[s]) and type(schedule[s][pc[s]]) in cost:
                instr = schedule[s][pc[s]]
                end = clock[s] + duration(s, instr)
                events.append(_event(s, instr, clock[s], end))
                clock[s] = end
                pc[s] += 1
                progressed = True
        sends, recvs = {}, {}
        for s in range(p):
            if pc[s] < len(schedule[s]):
                for k, part in enumerate(_parts(schedule[s][pc[s]])):
                    if k not in matched[s]:
                        is_send = isinstance(part, (SendAct, SendGrad))
                        key = message_key(part, s, placement)
                        if is_send and (buffered_sends or placement.rank_of(key[3], part.chunk) == s):
                            mailbox[key] = matched[s][k] = clock[s]
                            progressed = True
                            continue
                        side = sends if is_send else recvs
                        side[key] = (s, k)
        for key in mailbox.keys() & recvs.keys():
            b, kb = recvs.pop(key)
            matched[b][kb] = max(mailbox.pop(key) + comm_time, clock[b])  # in flight since sent
            progressed = True
        for key in sends.keys() & recvs.keys():
            (a, ka), (b, kb) = sends[key], recvs[key]
            matched[a][ka] = matched[b][kb] = max(clock[a], clock[b]) + comm_time
            progressed = True
        for s in range(p):
            if pc[s] < len(schedule[s]) and len(matched[s]) == len(_parts(schedule[s][pc[s]])):
                end = max(matched[s].values())
                events.append(_event(s, schedule[s][pc[s]], clock[s], end))
                clock[s], pc[s], matched[s] = end, pc[s] + 1, {}
        if all(pc[s] == len(schedule[s]) for s in range(p)):
            break
        if not progressed:
            raise DeadlockError({s: schedule[s][pc[s]] for s in range(p) if pc[s] < len(schedule[s])})
    return SimResult(
        num_stages=p, events=events, makespan=max(clock), bubble=bubble_fraction(events),
        peak_activations=[peak_activations(ops) for ops in schedule],
        peak_pending_weights=[peak_pending_weights(ops) for ops in schedule],
    )


def measured_costs(events):
    """`op_time` for `simulate` from measured spans (rank = stage): each compute op's own duration,
    keyed by (stage, op name, mb, chunk). A KeyError names an op the spans do not have."""
    took = {(e["rank"], e["name"], e["args"]["mb"], e["args"].get("chunk", 0)): e["t1"] - e["t0"]
            for e in events if e["cat"] == "compute" and "mb" in e.get("args", {})}
    return lambda stage, instr: took[(stage, type(instr).__name__, instr.mb, instr.chunk)]


def _parts(instr) -> tuple:
    return instr.ops if isinstance(instr, SendRecv) else (instr,)


def validate(schedule: list[list]) -> int:
    """Check a schedule's structure; return its number of chunks v. Raises ScheduleError.

    Each stage runs every (mb, chunk) exactly once forward and once backward, forward first; receives
    an input before computing on it and sends only what it has computed; and no message leaves the
    model's virtual stages 0 .. p*v-1 (as the schedule's `placement` numbers them).
    """
    p = len(schedule)
    if p < 1:
        raise ScheduleError("a schedule needs at least one stage")
    computes = [(s, i) for s, ops in enumerate(schedule) for i in ops if isinstance(i, COMPUTE)]
    if not computes:
        raise ScheduleError("schedule has no Forward or Backward at all")
    placement = placement_of(schedule)
    v, n = placement.chunks, placement.num_virtual
    if placement.num_stages != p or 1 + max(i.chunk for _, i in computes) > v:
        raise ScheduleError(f"schedule has {p} stages and chunks up to {max(i.chunk for _, i in computes)}, "
                            f"but its placement is {placement}")
    expected = {(i.mb, c) for _, i in computes for c in range(v)}
    if placement.copies == 2:  # two model copies: each microbatch goes through one of them
        expected = {(i.mb, i.chunk) for _, i in computes}
        both = {mb for mb, c in expected if (mb, 1 - c) in expected}
        if both:
            raise ScheduleError(f"microbatches {sorted(both)} go through both model copies (chunks 0 "
                                "and 1); in a dual placement each microbatch takes one")
    for s, ops in enumerate(schedule):
        done = Counter()  # (kind, mb, chunk) -> count so far
        for pos, instr in enumerate(ops):
            where = f"stage {s}, instruction {pos} {instr!r}"
            if isinstance(instr, COMPUTE):
                _check_compute(instr, done, where, placement.virtual_stage(s, instr.chunk), n)
            elif isinstance(instr, OptimizerStep):
                continue
            else:
                for part in _parts(instr):
                    if not isinstance(part, P2P):
                        raise ScheduleError(f"{where}: {part!r} is not an instruction a stage can run")
                    _, mb, src, dst = message_key(part, s, placement)
                    outside = [x for x in (src, dst) if not 0 <= x < n]
                    if outside:
                        raise ScheduleError(f"{where}: no virtual stage {outside[0]} (there are {n})")
                    c = part.chunk
                    if isinstance(part, SendAct) and not done[("Forward", mb, c)]:
                        raise ScheduleError(f"{where}: sends before its Forward(mb={mb}, chunk={c})")
                    if isinstance(part, SendGrad) and not (done[("Backward", mb, c)]
                                                           or done[("BackwardInput", mb, c)]):
                        raise ScheduleError(f"{where}: sends before its Backward or BackwardInput"
                                            f"(mb={mb}, chunk={c})")
                    done[(type(part).__name__, mb, part.chunk)] += 1
        have = {(mb, c) for (k, mb, c) in done if k == "Forward"}
        if have != expected:
            raise ScheduleError(f"stage {s} has no Forward for (mb, chunk) in {sorted(expected - have)}")
        whole = {(mb, c) for (k, mb, c) in done if k == "Backward"}
        split = {(mb, c) for (k, mb, c) in done if k == "BackwardWeight"}
        if whole | split != expected:
            raise ScheduleError(f"stage {s} has no Backward (or BackwardInput + BackwardWeight) for "
                                f"(mb, chunk) in {sorted(expected - whole - split)}")
    return v


def _check_compute(instr, done: Counter, where: str, vs: int, num_virtual: int) -> None:
    """One compute instruction's order rules: forward first, B before W, a backward's gradient received."""
    kind, mb, c = type(instr).__name__, instr.mb, instr.chunk
    if done[(kind, mb, c)]:
        raise ScheduleError(f"{where}: runs twice; each (mb, chunk) runs once each way")
    if kind != "Forward" and not done[("Forward", mb, c)]:
        what = "backward" if kind == "Backward" else kind
        raise ScheduleError(f"{where}: {what} before the forward of mb {mb} chunk {c}")
    if kind == "BackwardWeight" and not done[("BackwardInput", mb, c)]:
        raise ScheduleError(f"{where}: BackwardWeight before the BackwardInput of mb {mb} chunk {c}")
    if kind in ("Backward", "BackwardInput") and done[("Backward", mb, c)] + done[("BackwardInput", mb, c)]:
        raise ScheduleError(f"{where}: mb {mb} chunk {c} already ran its backward")
    if kind != "BackwardWeight":
        need = "RecvAct" if kind == "Forward" else "RecvGrad"
        boundary = vs == 0 if kind == "Forward" else vs == num_virtual - 1
        if not boundary and not done[(need, mb, c)]:
            raise ScheduleError(f"{where}: needs an earlier {need}(mb={mb}, chunk={c})")
    done[(kind, mb, c)] += 1


def _cat(instr) -> str:
    return "send" if all(isinstance(x, (SendAct, SendGrad)) for x in _parts(instr)) else "recv"


def _event(stage, instr, t0, t1) -> dict:
    if isinstance(instr, SendRecv):
        name, args = "SendRecv", {"ops": [repr(x) for x in instr.ops]}
    elif isinstance(instr, OptimizerStep):
        name, args = "OptimizerStep", {}
    else:
        name, args = type(instr).__name__, {"mb": instr.mb, "chunk": instr.chunk}
    cat = "compute" if isinstance(instr, COMPUTE + (OptimizerStep,)) else _cat(instr)
    return {"name": name, "cat": cat, "rank": stage, "t0": t0, "t1": t1, "args": args}


def peak_activations(ops: list) -> int:
    """Most (mb, chunk) activations held at once by one stage: +1 at each Forward, -1 at each Backward
    or BackwardInput (B frees most of them; what W still needs is `peak_pending_weights`)."""
    held = peak = 0
    for instr in ops:
        held += isinstance(instr, Forward) - isinstance(instr, (Backward, BackwardInput))
        peak = max(peak, held)
    return peak


def peak_pending_weights(ops: list) -> int:
    """Most microbatches whose B has run and whose W has not, at once: what a W-queue holds."""
    held = peak = 0
    for instr in ops:
        held += isinstance(instr, BackwardInput) - isinstance(instr, BackwardWeight)
        peak = max(peak, held)
    return peak


def timeline_events(events) -> list:
    """BackwardWeight drawn as 'W3ww' (the timeline letters an op by its name's first letter)."""
    return [dict(e, name="Weight") if e["name"] == "BackwardWeight" else e for e in events]


def ascii_timeline(result, width: int = 100) -> str:
    """One row per stage: 'F3ff' forward of mb 3, 'B3bbbb' backward (or B of a split one), 'W3ww' the
    weight gradients of a split one, '.' idle. Takes a SimResult or events."""
    if isinstance(result, SimResult):
        return ascii_timeline_from_events(timeline_events(result.events), width=width, label="stage")
    return ascii_timeline_from_events(timeline_events(result), width=width)
