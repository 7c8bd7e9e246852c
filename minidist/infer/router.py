"""Serving across data-parallel replicas: send each request to the least loaded one.

    result = route(model, requests, arrivals, replicas=4, policy="least_loaded",
                   slow=Slowdown("rank=1,factor=3"))

Each replica is a whole model copy with its own continuous-batching ``Scheduler``. ``"round_robin"``
sends the i-th arrival to replica i % R, blind to load; ``"least_loaded"`` to the replica with the
least outstanding work -- tokens still to compute there times the seconds per token it has measurably
taken -- ties to less KV cache in use, then round robin. The replicas run in one process under an
event clock: the replica whose clock is earliest takes its next step, whose real duration (times the
replica's slowdown, from ``slow``: any object with ``rank_factor`` and ``target``, such as
``minidist.resilience.stragglers.Slowdown``) advances its clock. Every policy gives the same tokens,
request by request. Chapter 13 (lessons/13-load-balancing.md) has the measurements.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from minidist.infer.generate import check_ids
from minidist.infer.scheduler import Request, Scheduler
from minidist.trace.spans import now

POLICIES = ("round_robin", "least_loaded")


def outstanding_tokens(s: Scheduler) -> int:
    """Tokens replica ``s`` still has to compute: prompts not yet prefilled and tokens to generate."""
    queued = list(s.pending) + list(s.waiting)
    return (sum(len(r.prompt) + r.max_new_tokens for r in queued)  # a preempted one recomputes its out too
            + sum(r.max_new_tokens - len(r.out) for r in s.running.values()))


def kv_in_use(s: Scheduler) -> int:
    """Bytes of KV cache holding tokens of the running requests."""
    return int(s.cache.memory(list(s.running))["used"])


def choose(policy: str, schedulers, arrival_index: int, seconds_per_token=None) -> int:
    """The replica for the ``arrival_index``-th request under ``policy``. ``seconds_per_token[i]``:
    replica i's measured pace (None: all equal); least-loaded compares outstanding tokens x pace."""
    n = len(schedulers)
    if policy == "round_robin":
        return arrival_index % n
    pace = [1.0] * n if seconds_per_token is None else seconds_per_token
    # ties (e.g. all idle) go round-robin, so idle replicas share the arrivals
    return min(range(n), key=lambda i: (outstanding_tokens(schedulers[i]) * pace[i], kv_in_use(schedulers[i]),
                                        (i - arrival_index) % n))


def measured_pace(rows, busy) -> list[float]:
    """Seconds per token of each replica so far (busy seconds / rows computed); a replica that has
    not run yet gets the mean of those that have (or 1 if none has)."""
    known = [b / r for r, b in zip(rows, busy) if r > 0]
    default = float(np.mean(known)) if known else 1.0
    return [b / r if r > 0 else default for r, b in zip(rows, busy)]


@dataclass
class Routed:
    """What ``route`` measured."""
    outputs: dict                                   # request id -> generated tokens
    latency: dict                                   # request id -> seconds from arrival to its last token
    replica_of: dict                                # request id -> replica it ran on
    makespan: float = 0.0                           # seconds until the last request finished
    tokens: int = 0
    busy: list = field(default_factory=list)        # per replica: seconds spent stepping

    def percentile(self, q: float) -> float:
        return float(np.percentile(list(self.latency.values()), q))

    @property
    def throughput(self) -> float:
        return self.tokens / self.makespan if self.makespan > 0 else 0.0


def route(model, requests, arrivals, replicas: int = 2, policy: str = "least_loaded", slow=None,
          max_batch: int = 4, **scheduler_kw) -> Routed:
    """Serve ``requests`` (``Request``s; ``arrivals[i]``: request i's arrival in seconds) on
    ``replicas`` replicas of ``model`` routed by ``policy``; ``slow`` (e.g. a ``Slowdown``) slows
    replicas as it slows ranks (``rank=i`` is replica i); None: none."""
    if policy not in POLICIES:
        raise ValueError(f"route: policy must be one of {POLICIES}, got {policy!r}")
    if not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"route: replicas must be an integer >= 1, got {replicas!r}")
    if len(arrivals) != len(requests) or any(not a >= 0 for a in arrivals):
        raise ValueError(f"route: give one arrival time >= 0 (seconds) per request: {len(requests)} "
                         f"requests, {len(arrivals)} arrivals")
    check_ids([r.id for r in requests], len(requests), "route: ")
    if slow is not None and not (hasattr(slow, "rank_factor") and hasattr(slow, "target")):
        raise ValueError(f"route: slow must slow replicas as a Slowdown does (rank_factor, target), e.g. "
                         f"minidist.resilience.stragglers.Slowdown('rank=1,factor=3'); got {slow!r}")
    if slow is not None and hasattr(slow, "check_world"):
        slow.check_world(replicas)
    scheds = [Scheduler(model, max_batch=max_batch, **scheduler_kw) for _ in range(replicas)]
    clocks, busy = [0.0] * replicas, [0.0] * replicas
    order = sorted(range(len(requests)), key=lambda i: (arrivals[i], requests[i].id))
    arrived_at, replica_of, latency = {}, {}, {}
    k = 0
    while k < len(order) or any(s.has_work() for s in scheds):
        working = [i for i in range(replicas) if scheds[i].has_work()]
        t_step = min((clocks[i] for i in working), default=float("inf"))
        if k < len(order) and arrivals[order[k]] <= t_step:  # the next event is an arrival: route it
            r = requests[order[k]]
            if r.max_new_tokens == 0:  # nothing to generate: done on arrival, on no replica
                arrived_at[r.id], latency[r.id], replica_of[r.id], k = arrivals[order[k]], 0.0, None, k + 1
                continue
            i = choose(policy, scheds, k, measured_pace([q.stats["forward_rows"] for q in scheds], busy))
            clocks[i] = max(clocks[i], arrivals[order[k]]) if not scheds[i].has_work() else clocks[i]
            scheds[i].submit(Request(r.id, list(r.prompt), r.max_new_tokens, r.sampling,
                                     tuple(r.stop_tokens), arrival=scheds[i].t))
            arrived_at[r.id], replica_of[r.id] = arrivals[order[k]], i
            k += 1
            continue
        i = min(working, key=lambda j: (clocks[j], j))
        rows = scheds[i].stats["forward_rows"]
        t0 = now()
        finished = scheds[i].step()
        real = now() - t0
        dt = real if slow is None else slow.target(real, scheds[i].stats["forward_rows"] - rows,
                                                   slow.rank_factor(i, 0))
        clocks[i] += dt
        busy[i] += dt
        for req in finished:
            latency[req.id] = clocks[i] - arrived_at[req.id]
    outputs = {r.id: [] for r in requests if r.max_new_tokens == 0}
    outputs.update({r.id: list(r.out) for s in scheds for r in s.done})
    return Routed(outputs=dict(sorted(outputs.items())), latency=latency, replica_of=replica_of,
                  makespan=max(clocks), tokens=sum(s.stats["tokens"] for s in scheds), busy=busy)


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """``n`` arrival times (seconds) of a Poisson process with ``rate`` requests per second."""
    rng = np.random.default_rng(seed)
    return np.cumsum(rng.exponential(1.0 / rate, n)).tolist()
