"""A pipeline schedule run on fewer cores than ranks: a ready rank waits for a core.

`simulate` (minidist.parallel.pipeline.simulate) gives every stage a core of its own. On a laptop
or a 2-core CI machine 8 ranks share 2 cores, and the timeline changes shape: a stage that has
work does not run it at full speed, because the cores are shared by every stage that has work at
that moment; a stage waiting for a message uses no core. `run_on_cores` models exactly that --
processor sharing: at each moment the n ranks inside a compute instruction each progress at
min(1, cores / n) of full speed -- and measures the bubble the way the lessons do (the idle share
of ranks x makespan, where a compute instruction's whole wall-clock span counts as busy, also the
part it spent waiting for a core).

Messages are the runtime's background sends (a send completes when posted; its receive once the
send is posted), and `replicas` copies of the schedule (data-parallel groups) run side by side on
the same cores, as dp x pp ranks do. What it leaves out: the operating system's time slices, the
cost of waking a sleeping rank, and the cores a waiting rank burns while it spins -- each makes the
measured bubble larger still.

Two checks written out (tests/plan/test_shared_cores.py): with cores >= ranks it is `simulate`
with buffered sends; with one core some rank always has work, so the makespan is the total work.
"""

from __future__ import annotations

from minidist.parallel.pipeline.placement import placement_of
from minidist.parallel.pipeline.schedule import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    OptimizerStep,
    SendAct,
    SendGrad,
    SendRecv,
    message_key,
)
from minidist.parallel.pipeline.simulate import DeadlockError, validate

BUSY = (Forward, Backward, BackwardInput, BackwardWeight)  # what the lessons' measured bubble counts


def run_on_cores(schedule: list[list], cores: float, fwd_time: float = 1.0, bwd_time: float = 2.0,
                 input_time: float | None = None, weight_time: float | None = None,
                 replicas: int = 1) -> dict:
    """Run `replicas` copies of `schedule` on `cores` shared cores (module docstring).

    Returns {"makespan", "bubble", "events"}: the events are (rank, name, t0, t1) of every compute
    instruction, rank = replica * p + stage. A split backward's B and W take `input_time` and
    `weight_time` (by default half of `bwd_time` each), as in `simulate`."""
    if cores <= 0:
        raise ValueError(f"run_on_cores: cores must be > 0, got {cores}")
    validate(schedule)
    p, placement = len(schedule), placement_of(schedule)
    cost = {Forward: fwd_time, Backward: bwd_time, OptimizerStep: 0.0,
            BackwardInput: bwd_time / 2 if input_time is None else input_time,
            BackwardWeight: bwd_time / 2 if weight_time is None else weight_time}
    ranks = [(r, s) for r in range(replicas) for s in range(p)]
    pc = [0] * len(ranks)
    left = [None] * len(ranks)       # work left in the current compute instruction (None: not started)
    start = [0.0] * len(ranks)
    got: list[set] = [set() for _ in ranks]  # parts of the current SendRecv already done
    posted: set = set()              # (replica, message key) of every send posted so far
    events, now = [], 0.0

    def advance_messages(i) -> None:
        """Rank i runs its sends and the receives whose send is posted, up to its next compute."""
        r, s = ranks[i]
        ops = schedule[s]
        while pc[i] < len(ops) and type(ops[pc[i]]) not in cost:
            instr = ops[pc[i]]
            parts = instr.ops if isinstance(instr, SendRecv) else (instr,)
            for k, part in enumerate(parts):
                key = (r, message_key(part, s, placement))
                if isinstance(part, (SendAct, SendGrad)):
                    posted.add(key)
                    got[i].add(k)
                elif key in posted:
                    got[i].add(k)
            if len(got[i]) < len(parts):
                return
            pc[i], got[i] = pc[i] + 1, set()

    while True:
        for _ in range(2):  # twice: a send posted late in the first pass releases an earlier rank
            for i in range(len(ranks)):
                advance_messages(i)
        active = [i for i in range(len(ranks)) if pc[i] < len(schedule[ranks[i][1]])
                  and type(schedule[ranks[i][1]][pc[i]]) in cost]
        for i in active:
            if left[i] is None:
                left[i], start[i] = cost[type(schedule[ranks[i][1]][pc[i]])], now
        if not active:
            if all(pc[i] == len(schedule[s]) for i, (_, s) in enumerate(ranks)):
                break
            raise DeadlockError({i: schedule[s][pc[i]] for i, (_, s) in enumerate(ranks)
                                 if pc[i] < len(schedule[s])})
        rate = min(1.0, cores / len(active))
        dt = min(left[i] for i in active) / rate
        now += dt
        for i in active:
            left[i] -= dt * rate
            if left[i] <= 1e-12:
                instr = schedule[ranks[i][1]][pc[i]]
                if isinstance(instr, BUSY):
                    events.append((i, type(instr).__name__, start[i], now))
                pc[i], left[i] = pc[i] + 1, None
    busy = sum(t1 - t0 for _, _, t0, t1 in events)
    bubble = 1.0 - busy / (len(ranks) * now) if now > 0 else 0.0
    return {"makespan": now, "bubble": bubble, "events": events}
