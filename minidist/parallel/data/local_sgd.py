"""Local SGD and DiLoCo: communicate every H steps instead of every step.

    outer = LocalSGD(model, comm, inner=AdamW(model.parameters()), H=20, outer_lr=0.7, momentum=0.9)
    for x, y in batches:
        model.loss(x, y).backward()
        outer.step()                    # the inner step; every H-th also the outer (synchronising) step
        inner.zero_grad()

Each rank runs H steps of any optimizer on its own data, then the ranks average the **outer
gradient** Δ = anchor - θ and every rank applies the same outer step (Nesterov SGD, chapter 12):
``v = μ·v + Δ̄; anchor -= outer_lr·(Δ̄ + μ·v); θ = anchor``. DiLoCo (Douillard et al. 2023): inner
AdamW, H = 500, outer lr 0.7, μ 0.9. With H = 1, outer lr 1, μ = 0 it *is* DDP. **Streaming**
(``fragments=F``, ``overlap=τ``): F fragments sync at staggered steps, each all-reduce running
during the next τ inner steps (θ = anchor + (θ_now - θ_sent) when it lands). The anchors are
identical on every rank after every sync.
"""

from __future__ import annotations

import numpy as np

from minidist.comm import all_reduce, start_async
from minidist.parallel.data.buckets import GradBucket, build_buckets
from minidist.parallel.data.replicas import broadcast_parameters, check_same_model


class Fragment:
    """Parameters synchronised together: their flat anchor, outer momentum and (streaming) the
    all-reduce in flight."""

    def __init__(self, index: int, params: list):
        self.index, self.params = index, params
        self.buckets = build_buckets(params, float("inf"))  # one flat array per dtype
        self.anchors = [b.flatten([p.data for p in b.params]).copy() for b in self.buckets]
        self.velocity = [np.zeros_like(a) for a in self.anchors]
        self.pending = None   # (step due, handles, θ at the send) of an overlapped sync


def outer_step(frag: Fragment, i: int, outer_grad, outer_lr: float, momentum: float, nesterov: bool = True):
    """The outer (Nesterov) step of fragment ``frag``'s bucket i with the averaged Δ̄; returns the new
    anchor: ``v = μ·v + Δ̄; anchor -= outer_lr·(Δ̄ + μ·v)`` (or ``v`` without Nesterov)."""
    v = frag.velocity[i] = momentum * frag.velocity[i] + outer_grad
    update = outer_grad + momentum * v if nesterov else v
    frag.anchors[i] = frag.anchors[i] - outer_lr * update
    return frag.anchors[i]


class LocalSGD:
    """H local steps of ``inner`` per sync of the parameter delta over ``comm`` (see module docstring).

    ``comm_hook``: a (state, hook) pair from ``minidist.parallel.data.compress`` the delta goes through
    (None: a plain all-reduce). ``fragments``/``overlap``: the streaming variant.
    """

    def __init__(self, model, comm, inner, H: int = 20, outer_lr: float = 0.7, momentum: float = 0.9,
                 nesterov: bool = True, comm_hook=None, fragments: int = 1, overlap: int = 0,
                 broadcast_from: int | None = 0, algorithm: str = "ring"):
        if H < 1 or fragments < 1 or not 0 <= overlap < H:
            raise ValueError(f"rank {comm.rank}: LocalSGD needs H >= 1, fragments >= 1 and 0 <= overlap < H; "
                             f"got H={H}, fragments={fragments}, overlap={overlap}")
        if not 0 <= momentum < 1 or outer_lr <= 0:
            raise ValueError(f"rank {comm.rank}: LocalSGD outer_lr must be > 0 and momentum in [0, 1); "
                             f"got {outer_lr}, {momentum}")
        self.model, self.comm, self.inner = model, comm, inner
        self.H, self.outer_lr, self.momentum, self.nesterov = H, outer_lr, momentum, nesterov
        self.comm_hook, self.overlap, self.algorithm = comm_hook, overlap, algorithm
        check_same_model(comm, model)
        if broadcast_from is not None:
            broadcast_parameters(comm, model, broadcast_from)
        params = [p for p in model.parameters() if p.requires_grad]
        if fragments > len(params):
            raise ValueError(f"rank {comm.rank}: fragments={fragments} but the model has {len(params)} "
                             "trainable parameters")
        cuts = np.array_split(np.arange(len(params)), fragments)
        self.fragments = [Fragment(f, [params[i] for i in ix]) for f, ix in enumerate(cuts)]
        self._bucket_id = {id(b): k for k, b in enumerate(b for f in self.fragments for b in f.buckets)}
        self.t = 0          # inner steps taken
        self.started: list = []  # (step, fragment) of every sync started: the schedule, as data

    def offset(self, f: int) -> int:
        """Fragment f syncs when (t + offset) % H == 0: staggered by H/F steps."""
        return f * self.H // len(self.fragments)

    def step(self) -> None:
        """One inner step; then finish the overlapped syncs that are due, and start the ones due now."""
        self.inner.step()
        self.t += 1
        for frag in self.fragments:
            if frag.pending is not None and frag.pending[0] == self.t:
                self._finish(frag)
        for f, frag in enumerate(self.fragments):
            if (self.t + self.offset(f)) % self.H == 0:
                self._start(frag)
                if self.overlap == 0:
                    self._finish(frag)

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    # -- one fragment's sync: Δ = anchor - θ, averaged, then the outer Nesterov step ------------
    def _start(self, frag: Fragment) -> None:
        handles, sent = [], []
        for b, anchor in zip(frag.buckets, frag.anchors):
            theta = b.flatten([p.data for p in b.params])
            sent.append(theta)
            handles.append(self._reduce(b, anchor - theta))
        frag.pending = (self.t + self.overlap, handles, sent)
        self.started.append((self.t, frag.index))

    def _reduce(self, b, delta):
        """Start Σ_r Δ_r: through the hook if one is set (its per-bucket state keyed by the bucket's
        place in the model), else an all-reduce."""
        if self.comm_hook is None:
            return start_async(self.comm, lambda c, x: all_reduce(c, x, op="sum", algorithm=self.algorithm),
                               delta)
        state, hook = self.comm_hook
        return hook(state, GradBucket(self._bucket_id[id(b)], delta, [p.shape for p in b.params], self.comm,
                                      algorithm=self.algorithm))

    def _finish(self, frag: Fragment) -> None:
        _, handles, sent = frag.pending
        frag.pending = None
        p = self.comm.size
        for i, (b, handle) in enumerate(zip(frag.buckets, handles)):
            theta = outer_step(frag, i, handle.wait() / p, self.outer_lr, self.momentum, self.nesterov)
            if self.overlap:  # keep what the inner steps did while the sync was in flight
                theta = theta + (b.flatten([q.data for q in b.params]) - sent[i])
            for q, v_ in zip(b.params, b.views(theta.copy())):
                q.data = v_.astype(q.dtype, copy=False)

    def finish_pending(self) -> None:
        """Apply every overlapped sync still in flight (at the end of training)."""
        for frag in self.fragments:
            if frag.pending is not None:
                self._finish(frag)

    def anchors(self) -> list:
        """Every fragment's flat anchors (identical on every rank after each sync)."""
        return [a for frag in self.fragments for a in frag.anchors]


def streaming_diloco(model, comm, inner, H: int = 20, fragments: int = 4, overlap: int = 1, **kw) -> LocalSGD:
    """Streaming DiLoCo: ``fragments`` staggered fragments, each sync overlapped with ``overlap`` steps."""
    return LocalSGD(model, comm, inner, H=H, fragments=fragments, overlap=overlap, **kw)
