"""LocalSGD and DiLoCo over a quorum: the outer step averages over the replica groups present.

    outer = QuorumLocalSGD(model, quorum, inner=AdamW(model.parameters()), H=20, outer_lr=0.7, momentum=0.9)
    for x, y in batches:
        model.loss(x, y).backward()
        outer.step()          # the inner step; every H-th step also the outer step, over the step's quorum
        inner.zero_grad()

Chapter 12's LocalSGD (one fragment, no overlap) with the outer gradient Δ = anchor - θ averaged by
``quorum_average`` over the groups taking part in the sync step. A group lost between syncs takes its
local steps with it; the others' outer step goes on without it. Every step passes through
``quorum.reduce`` (empty between syncs), so a live job commits each step. A replacement heals only at a
sync step (``heals_at``): it takes a live peer's anchor, outer momentum (``arrays``) and inner optimizer
state, receives Δ̄ (``receive_step``) and leaves the step at the new anchor, like every group.
"""

from __future__ import annotations

import numpy as np

from minidist.parallel.data.live.quorum_ddp import quorum_average
from minidist.parallel.data.local_sgd import Fragment, outer_step


class QuorumLocalSGD:
    """H inner steps of ``inner`` per outer step over ``quorum`` (see the module docstring)."""

    def __init__(self, model, quorum, inner, H: int = 20, outer_lr: float = 0.7, momentum: float = 0.9,
                 nesterov: bool = True):
        if H < 1 or not 0 <= momentum < 1 or outer_lr <= 0:
            raise ValueError(f"QuorumLocalSGD needs H >= 1, outer_lr > 0 and momentum in [0, 1); got H={H}, "
                             f"outer_lr={outer_lr}, momentum={momentum}")
        self.model, self.quorum, self.inner = model, quorum, inner
        self.H, self.outer_lr, self.momentum, self.nesterov = H, outer_lr, momentum, nesterov
        self.frag = Fragment(0, [p for p in model.parameters() if p.requires_grad])
        self.t = 0   # inner steps taken (a healer's count comes from its donor)

    def heals_at(self, step: int) -> bool:
        """A replacement may join at ``step`` only if it ends with an outer step (all θ = the anchor)."""
        return (step + 1) % self.H == 0

    def step(self) -> None:
        """The inner step, then this step's reduction: Δ averaged over the quorum when a sync is due."""
        self.inner.step()
        self._sync(lambda: [a - b.flatten([p.data for p in b.params])
                            for a, b in zip(self.frag.anchors, self.frag.buckets)])

    def receive_step(self) -> None:
        """A healer's step: no inner step (it has no gradient); it receives Δ̄ and takes the outer step."""
        self._sync(lambda: [np.zeros_like(a) for a in self.frag.anchors])

    def _sync(self, deltas) -> None:
        def fn(view):  # run after a heal: t and the anchors are then the donor's
            return [quorum_average(view, d) for d in deltas()] if (self.t + 1) % self.H == 0 else None
        averages = self.quorum.reduce(fn)
        self.t += 1
        if averages is None:
            return
        for i, (b, avg) in enumerate(zip(self.frag.buckets, averages)):
            theta = outer_step(self.frag, i, avg, self.outer_lr, self.momentum, self.nesterov)
            for q, v in zip(b.params, b.views(theta.copy())):
                q.data = v.astype(q.dtype, copy=False)

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def state_dict(self) -> dict:
        return {"t": self.t}

    def load_state_dict(self, sd: dict) -> None:
        self.t = sd["t"]

    def arrays(self) -> dict:
        """The anchors and outer momentum (the same on every group): what a heal moves besides the
        parameters and the inner optimizer's state."""
        return {**{f"anchor/{i}": a for i, a in enumerate(self.frag.anchors)},
                **{f"velocity/{i}": v for i, v in enumerate(self.frag.velocity)}}

    def load_arrays(self, arrays: dict) -> None:
        for key, a in arrays.items():
            kind, i = key.split("/")
            (self.frag.anchors if kind == "anchor" else self.frag.velocity)[int(i)] = np.array(a, copy=True)
