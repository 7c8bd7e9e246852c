"""How much communication a computation hid: the overlap of "comm" intervals with "backward" ones.

Data parallelism's sync window records ``(name, kind, t0, t1)`` events -- kind "backward" (the
syncing backward) or "comm" (each collective, timed where it really ran: on the async worker);
``hidden_fraction`` says which share of the communication time fell inside the backward.
"""

from __future__ import annotations


def hidden_fraction(events) -> float:
    """Share of communication time that ran while backward was computing (events as above)."""
    back = [(t0, t1) for _, kind, t0, t1 in events if kind == "backward"]
    comm = [(t0, t1) for _, kind, t0, t1 in events if kind == "comm"]
    total = sum(t1 - t0 for t0, t1 in comm)
    if total <= 0:
        return 0.0
    hidden = sum(max(0.0, min(t1, b1) - max(t0, b0)) for t0, t1 in comm for b0, b1 in back)
    return hidden / total
