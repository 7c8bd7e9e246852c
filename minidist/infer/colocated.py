"""Colocated serving, the baseline disaggregated serving is measured against: every rank both prefills
and decodes, a whole-model continuous-batching ``Scheduler`` for requests i % size (in arrival order),
each request's prefill sharing its steps with the others' decodes. Returns the same ``Served``.
"""

from __future__ import annotations

import time
from collections import deque

from minidist.infer.disaggregated import Served, check_requests, copy, gathered, start, wait_until
from minidist.infer.scheduler import Scheduler


def colocated_serve(comm, model, requests, arrivals=None, max_batch: int = 4, **scheduler_kw) -> Served:
    """Serve ``requests`` (arriving at ``arrivals`` seconds), rank r serving requests r, r + size, ..."""
    reqs, arr = check_requests(comm, model, requests, arrivals, f"rank {comm.rank}: ")
    mine = [(copy(r), a) for i, (r, a) in enumerate(zip(reqs, arr)) if i % comm.size == comm.rank]
    sched = Scheduler(model, max_batch=max_batch, **scheduler_kw)
    out, first, last, arrival = {}, {}, {}, {}
    t0 = start(comm)
    todo = deque(mine)
    while todo or sched.has_work():
        now = time.time() - t0
        while todo and todo[0][1] <= now:
            r, a = todo.popleft()
            arrival[r.id] = a
            if r.max_new_tokens == 0:
                out[r.id] = []
                continue
            r.arrival = sched.t
            sched.submit(r)
        if not sched.has_work():
            if todo:
                wait_until(t0, todo[0][1])
            continue
        finished = sched.step()
        now = time.time() - t0
        for r in [*sched.running.values(), *finished]:
            if r.out and r.id not in first:
                first[r.id] = now
        for r in finished:
            out[r.id], last[r.id] = list(r.out), now
    return gathered(comm, (out, first, last, arrival), 0, t0)
