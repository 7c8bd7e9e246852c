"""Run a pipeline schedule in one process without communication: timing, deadlocks, bubble, memory.

`simulate(schedule)` steps all stages' instruction lists together. Compute instructions take
`fwd_time` / `bwd_time` (per model chunk) and `opt_time`. Sends and receives are blocking with
rendezvous semantics: a send and its matching receive (same `message_key`) both complete at
max(the times the two stages posted them) + `comm_time`; a `SendRecv` completes when all its parts
have. If no stage can move, the schedule deadlocks under blocking point-to-point: `DeadlockError`
names every stage's blocked instruction. The result is deterministic: each match depends only on
the two stages' own histories, not on the order the simulator finds it.

Bubble definition used throughout (`minidist.trace.bubble_fraction`): the idle share of the
rectangle p stages x [0, makespan], where only forward and backward count as busy. With
comm_time = 0, GPipe and 1F1B give exactly (p-1)/(m+p-1) for any fwd_time and bwd_time (every
stage is busy m*(f+b) out of a makespan of (m+p-1)*(f+b)); interleaved 1F1B with v chunks gives
(p-1)/(v*m+p-1) when fwd_time == bwd_time.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from minidist.parallel.pipeline.schedule import (
    P2P,
    Backward,
    Forward,
    OptimizerStep,
    ScheduleError,
    SendAct,
    SendGrad,
    SendRecv,
    message_key,
    virtual_stage,
)
from minidist.trace import ascii_timeline_from_events, bubble_fraction


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


def bubble_formula(num_stages: int, num_microbatches: int, chunks: int = 1) -> float:
    """Textbook bubble fraction (p-1)/(v*m + p-1); v = 1 for GPipe and 1F1B."""
    p, m, v = num_stages, num_microbatches, chunks
    return (p - 1) / (v * m + p - 1)


def _parts(instr) -> tuple:
    return instr.ops if isinstance(instr, SendRecv) else (instr,)


def validate(schedule: list[list]) -> int:
    """Check a schedule's structure; return its number of chunks v. Raises ScheduleError.

    Each stage runs every (mb, chunk) exactly once forward and once backward, forward first; receives
    an input before computing on it and sends only what it has computed; and no message leaves the
    model's virtual stages 0 .. p*v-1.
    """
    p = len(schedule)
    if p < 1:
        raise ScheduleError("a schedule needs at least one stage")
    computes = [(s, i) for s, ops in enumerate(schedule) for i in ops if isinstance(i, (Forward, Backward))]
    if not computes:
        raise ScheduleError("schedule has no Forward or Backward at all")
    v = 1 + max(i.chunk for _, i in computes)
    mbs = {i.mb for _, i in computes}
    expected = {(mb, c) for mb in mbs for c in range(v)}
    for s, ops in enumerate(schedule):
        done = Counter()  # (kind, mb, chunk) -> count so far
        for pos, instr in enumerate(ops):
            where = f"stage {s}, instruction {pos} {instr!r}"
            if isinstance(instr, (Forward, Backward)):
                kind, mb, c = type(instr).__name__, instr.mb, instr.chunk
                if done[(kind, mb, c)]:
                    raise ScheduleError(f"{where}: runs twice; each (mb, chunk) runs once each way")
                if kind == "Backward" and not done[("Forward", mb, c)]:
                    raise ScheduleError(f"{where}: backward before the forward of mb {mb} chunk {c}")
                vs = virtual_stage(s, c, p)
                need = "RecvAct" if kind == "Forward" else "RecvGrad"
                boundary = vs == 0 if kind == "Forward" else vs == p * v - 1
                if not boundary and not done[(need, mb, c)]:
                    raise ScheduleError(f"{where}: needs an earlier {need}(mb={mb}, chunk={c})")
                done[(kind, mb, c)] += 1
            elif isinstance(instr, OptimizerStep):
                continue
            else:
                for part in _parts(instr):
                    if not isinstance(part, P2P):
                        raise ScheduleError(f"{where}: {part!r} is not an instruction a stage can run")
                    _, mb, src, dst = message_key(part, s, p)
                    outside = [x for x in (src, dst) if not 0 <= x < p * v]
                    if outside:
                        raise ScheduleError(f"{where}: no virtual stage {outside[0]} (there are {p * v})")
                    source_op = {SendAct: "Forward", SendGrad: "Backward"}.get(type(part))
                    c = part.chunk
                    if source_op and not done[(source_op, mb, c)]:
                        raise ScheduleError(f"{where}: sends before its {source_op}(mb={mb}, chunk={c})")
                    done[(type(part).__name__, mb, part.chunk)] += 1
        for kind in ("Forward", "Backward"):
            have = {(mb, c) for (k, mb, c) in done if k == kind}
            if have != expected:
                missing = sorted(expected - have)
                raise ScheduleError(f"stage {s} has no {kind} for (mb, chunk) in {missing}")
    return v


def _cat(instr) -> str:
    return "send" if all(isinstance(x, (SendAct, SendGrad)) for x in _parts(instr)) else "recv"


def _event(stage, instr, t0, t1) -> dict:
    if isinstance(instr, SendRecv):
        name, args = "SendRecv", {"ops": [repr(x) for x in instr.ops]}
    elif isinstance(instr, OptimizerStep):
        name, args = "OptimizerStep", {}
    else:
        name, args = type(instr).__name__, {"mb": instr.mb, "chunk": instr.chunk}
    cat = "compute" if isinstance(instr, (Forward, Backward, OptimizerStep)) else _cat(instr)
    return {"name": name, "cat": cat, "rank": stage, "t0": t0, "t1": t1, "args": args}


def peak_activations(ops: list) -> int:
    """Most (mb, chunk) activations held at once by one stage: +1 at each Forward, -1 at each Backward."""
    held = peak = 0
    for instr in ops:
        held += isinstance(instr, Forward) - isinstance(instr, Backward)
        peak = max(peak, held)
    return peak


def simulate(schedule: list[list], fwd_time: float = 1.0, bwd_time: float = 2.0, comm_time: float = 0.0,
             opt_time: float = 0.0) -> SimResult:
    """Execute all stages in lock step (see module docstring); raise DeadlockError if they get stuck."""
    validate(schedule)
    p = len(schedule)
    cost = {Forward: fwd_time, Backward: bwd_time, OptimizerStep: opt_time}
    pc = [0] * p
    clock = [0.0] * p
    matched: list[dict] = [{} for _ in range(p)]  # part index -> completion time, for the current instr
    events = []
    while True:
        progressed = False
        for s in range(p):  # compute never blocks
            while pc[s] < len(schedule[s]) and type(schedule[s][pc[s]]) in cost:
                instr = schedule[s][pc[s]]
                events.append(_event(s, instr, clock[s], clock[s] + cost[type(instr)]))
                clock[s] += cost[type(instr)]
                pc[s] += 1
                progressed = True
        sends, recvs = {}, {}
        for s in range(p):
            if pc[s] < len(schedule[s]):
                for k, part in enumerate(_parts(schedule[s][pc[s]])):
                    if k not in matched[s]:
                        side = sends if isinstance(part, (SendAct, SendGrad)) else recvs
                        side[message_key(part, s, p)] = (s, k)
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
    )


def ascii_timeline(result, width: int = 100) -> str:
    """One row per stage: 'F3ff' forward of mb 3, 'B3bbbb' backward, '.' idle. Takes a SimResult or events."""
    if isinstance(result, SimResult):
        return ascii_timeline_from_events(result.events, width=width, label="stage")
    return ascii_timeline_from_events(list(result), width=width)
