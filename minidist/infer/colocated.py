"""Colocated serving, the baseline disaggregated serving is measured against: every rank both prefills
and decodes, a whole-model continuous-batching ``Scheduler`` for requests i % size (in arrival order),
each request's prefill sharing its steps with the others' decodes. Returns the same ``Served``.
"""

from __future__ import annotations

from collections import deque

from minidist.infer.disaggregated import Served, check_requests, gathered, start
from minidist.infer.scheduler import Request, Scheduler
from minidist.trace.spans import now, sleep


def copy(r: Request) -> Request:
    return Request(r.id, [int(t) for t in r.prompt], r.max_new_tokens, r.sampling, tuple(r.stop_tokens))


def colocated_serve(comm, model, requests, arrivals=None, max_batch: int = 4, **scheduler_kw) -> Served:
    """Serve ``requests`` (arriving at ``arrivals`` seconds), rank r serving requests r, r + size, ..."""
    who = f"rank {comm.rank}: "
    reqs, arr = check_requests(comm, model, requests, arrivals, who)
    mine = [(copy(r), a) for i, (r, a) in enumerate(zip(reqs, arr)) if i % comm.size == comm.rank]
    sched = Scheduler(model, max_batch=max_batch, **scheduler_kw)
    out, first, last, arrival = {}, {}, {}, {}
    t0 = start(comm, model, reqs, arr, who)
    todo = deque(mine)
    while todo or sched.has_work():
        while todo and t0 + todo[0][1] <= now():  # the same sum sleep() waits for: no float gap
            r, a = todo.popleft()
            arrival[r.id] = a
            if r.max_new_tokens == 0:
                out[r.id] = []
                continue
            r.arrival = sched.t
            sched.submit(r)
        if not sched.has_work():
            if todo:
                sleep(t0 + todo[0][1] - now())
            continue
        finished = sched.step()
        t = now() - t0
        for r in [*sched.running.values(), *finished]:
            if r.out and r.id not in first:
                first[r.id] = t
        for r in finished:
            out[r.id], last[r.id] = list(r.out), t
    return gathered(comm, (out, first, last, arrival), 0, t0)
