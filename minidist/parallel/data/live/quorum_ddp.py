"""Data parallelism over a quorum: the gradient averaged over the replica groups that took part.

    ddp = QuorumDataParallel(stage, quorum)   # quorum: a live job's member, or StaticQuorum(dp_comm)
    ... backward ...
    ddp.wait_gradients()                      # p.grad = the mean over this step's participating groups
    opt.step()

Each step the quorum says which groups take part. ``quorum_average`` sums the participants' gradients
*in group order* (a two-shot all-reduce: every chunk is added up rank 0, 1, 2, ... on its owner), divides
by their number n, and sends the result to the healers, who contribute nothing but step like everyone.
The fixed order makes the result the serial twin's ``((g0 + g1) + g2) / n`` bit for bit, whichever
groups were there. ``quorum.reduce(fn)`` runs ``fn(view)`` until the step commits -- again on the
groups left, if one fails during it. ``StaticQuorum``: every replica, every step (plain DDP's average).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

from minidist.comm import two_shot_all_reduce
from minidist.parallel.data.buckets import build_buckets

RESULT_TAG = 5


def quorum_average(view, x: np.ndarray) -> np.ndarray:
    """The mean over the participating groups of their ``x``, on participants and healers alike.

    ``view.participants``: this position's ranks of the participating groups, in group order (None on
    a healer); ``view.everyone``: the participants then the healers; ``view.n``: the participants."""
    avg = None
    if view.participants is not None:
        avg = two_shot_all_reduce(view.participants, x, "sum") / view.n
    everyone = view.everyone
    if everyone.rank == 0:
        for r in range(view.n, everyone.size):  # the healers: the same average, from the first participant
            everyone.send(avg, r, RESULT_TAG)
    elif everyone.rank >= view.n:
        avg = everyone.recv(0, RESULT_TAG)
    return avg


@dataclass
class StaticView:
    participants: object
    everyone: object
    n: int


class StaticQuorum:
    """Every replica of ``comm`` takes part in every step (no failures): DDP's average."""

    def __init__(self, comm):
        self.comm = comm

    def reduce(self, fn):
        return fn(StaticView(self.comm, self.comm, self.comm.size))


class QuorumDataParallel:
    """Average ``module``'s gradients over a quorum of replica groups (see the module docstring).
    ``ignore``: parameters never averaged (none here: experts are refused with live recovery)."""

    def __init__(self, module, quorum, ignore=()):
        self.module, self.quorum = module, quorum
        self.params = [p for p in module.parameters() if p.requires_grad and all(p is not q for q in ignore)]
        self.buckets = build_buckets(self.params, float("inf"))   # one flat array per dtype

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside only accumulates ``p.grad`` (the reduction is ``wait_gradients``'s)."""
        yield

    def wait_gradients(self) -> None:
        """``p.grad`` = the mean over this step's participants (a healer receives it)."""
        flats = [b.flatten([p.grad if p.grad is not None else np.zeros(p.shape, p.dtype) for p in b.params])
                 for b in self.buckets]
        averages = self.quorum.reduce(lambda view: [quorum_average(view, f) for f in flats])
        for b, avg in zip(self.buckets, averages):
            for p, v in zip(b.params, b.views(avg)):
                p.grad = v
