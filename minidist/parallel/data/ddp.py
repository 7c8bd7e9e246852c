"""Data parallelism (DDP): every rank holds the whole model and a slice of the batch.

    ddp = DistributedDataParallel(model, comm, bucket_bytes=1 << 20)
    for micro in range(k):                                # gradient accumulation
        with ddp.no_sync() if micro < k - 1 else contextlib.nullcontext():
            ddp.backward(model.loss(x[micro], y[micro]), n_samples=len(x[micro]))
    ddp.wait_gradients()                                  # p.grad = the global-batch gradient
    opt.step()

``backward`` seeds backward with this rank's sample count n_r; *a hook fires* (``grad_ready``)
and counts its bucket down; *a bucket is ready*: ``start_bucket`` starts its all-reduce on the async
worker while backward goes on, buckets in order on every rank; *at the end* ``wait_gradients``
waits and divides by N = Σ n_r (a rank's gradient weighs n_r / N: chapter 3). A ``SyncWindow``
holds what one window (every backward since the last sync) did, its timeline (``events``) too.
ZeRO (``zero.py``) replaces ``reduce`` and ``finish``.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import numpy as np

from minidist.comm import all_reduce, all_reduce_async, start_async
from minidist.parallel.data.buckets import Bucket, GradBucket, build_buckets
from minidist.parallel.data.replicas import broadcast_parameters, check_same_model, model_signature
from minidist.trace.spans import current, span

__all__ = ["DDP", "Bucket", "DistributedDataParallel", "SyncWindow", "broadcast_parameters", "build_buckets",
           "check_same_model", "model_signature"]


@dataclass(slots=True)
class SyncWindow:
    """What one window did: every backward from one sync to the next (accumulation's micro-steps,
    the last one syncs) and the collectives they started."""

    pending: list[int]          # per bucket: gradients the syncing backward has still to produce
    syncing: bool = True        # does this backward sync (False inside no_sync())
    weight: float = 0.0         # Σ n_samples of this rank in the window
    weighted: bool = False      # did backward() get n_samples?
    micro: int = 0              # backward passes (through DDP.backward)
    count: object = None        # Handle of the all-reduce of Σ n_samples: the divisor N
    next: int = 0               # the next bucket to start (buckets start in order)
    handles: dict = field(default_factory=dict)  # bucket index -> Handle of its collective
    used: dict = field(default_factory=dict)     # id(param) -> did it have a gradient here
    in_backward: bool = False
    hooked: bool = False        # did any gradient hook fire (also for plain loss.backward())?
    synced: bool = False        # has a syncing backward run? (then wait_gradients must come next)
    started_in_backward: int = 0  # buckets whose collective began during backward
    events: list = field(default_factory=list)  # (name, "backward" | "comm", t0, t1)


class DistributedDataParallel:
    """Wrap ``module`` for data parallelism over ``comm``. ``algorithm``: the all-reduce.
    ``find_unused_parameters``: a parameter no rank produced a gradient for keeps ``grad=None`` (as in
    the serial twin), not zeros. Frozen parameters are broadcast once, never communicated. ``ignore``:
    parameters DDP never averages (expert-parallel ones); with them pass ``broadcast_from=None``."""

    def __init__(self, module, comm, bucket_bytes: float = 4 << 20, algorithm: str = "ring",
                 find_unused_parameters: bool = False, broadcast_from: int | None = 0, ignore=()):
        self.module, self.comm = module, comm
        self.algorithm, self.find_unused = algorithm, find_unused_parameters
        check_same_model(comm, module)
        if broadcast_from is not None:
            broadcast_parameters(comm, module, broadcast_from)
        self.params = [p for p in module.parameters() if p.requires_grad and all(p is not q for q in ignore)]
        self.buckets = self.make_buckets(bucket_bytes)
        self._bucket_index = {id(p): b.index for b in self.buckets for p in b.params}
        self._comm_hook = None  # (state, hook) of register_comm_hook; None: the plain all-reduce
        self.window = self._new_window()
        self.last_window: SyncWindow | None = None  # the window wait_gradients closed last
        for p in self.params:
            p.register_post_accumulate_grad_hook(self.grad_ready)

    def make_buckets(self, bucket_bytes) -> list[Bucket]:
        """Gradients in the order backward produces them (reverse parameter order), bucketed."""
        return build_buckets(reversed(self.params), bucket_bytes)

    def _new_window(self) -> SyncWindow:
        return SyncWindow([len(b.params) for b in self.buckets])

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def parameters(self):
        return self.module.parameters()

    def zero_grad(self):
        self.module.zero_grad()

    # -- backward: weight, accumulate, sync on the window's last -------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside only accumulates ``p.grad``; the first backward after it syncs it all."""
        w = self.window
        prev, w.syncing = w.syncing, False
        try:
            yield
        finally:
            w.syncing = prev

    def backward(self, loss, n_samples: int | None = None):
        """``loss.backward()`` of the *mean* over this rank's ``n_samples`` terms (``GPT.loss``: the
        valid tokens, ``int((y != -1).sum())``). All ranks pass n_samples, or none does."""
        w = self.window
        if n_samples is not None:
            if n_samples < 0:
                raise ValueError(f"rank {self.comm.rank}: n_samples must be >= 0, got {n_samples}")
            w.weighted = True
        if w.synced:
            raise RuntimeError(f"rank {self.comm.rank}: backward() after a syncing backward without "
                               "wait_gradients() in between; wrap the earlier micro-steps in no_sync()")
        weight = 1.0 if n_samples is None else float(n_samples)
        w.weight += weight
        w.micro += 1
        if w.syncing and w.weighted:  # queued first: the worker runs it before any bucket
            self._start_count(w)
        w.in_backward, t0 = True, self.now()
        try:
            with span("backward", "compute"):
                loss.backward(loss.backend.from_host(np.full(loss.data.shape, weight, dtype=loss.dtype)))
        finally:
            w.in_backward = False
        if w.syncing:  # the window's timeline: its syncing backward
            w.events.append(("backward", "backward", t0, self.now()))
        w.synced = w.syncing

    def now(self) -> float:
        """The events' time: this thread's lane of the rank's virtual clock when it runs, else wall."""
        return time.perf_counter() if self.comm.clock is None else self.comm.clock.now()

    def _start_count(self, w: SyncWindow):
        """Queue the all-reduce of Σ n_samples, the divisor N (first: the worker runs it first)."""
        w.count = all_reduce_async(self.comm, np.array([w.weight]), op="sum")

    # -- hook fires -> bucket ready -> start its collective -------------------------------------
    def grad_ready(self, p):
        """Every parameter's post-accumulate-grad hook: count its bucket down, start the complete ones."""
        w = self.window
        w.hooked = True
        if not w.syncing:
            return
        w.pending[self._bucket_index[id(p)]] -= 1
        while w.next < len(self.buckets) and w.pending[w.next] == 0:  # in order
            self.start_bucket(self.buckets[w.next])
            w.next += 1

    def start_bucket(self, b: Bucket):
        """Flatten bucket ``b``'s gradients (None -> zeros) and start its collective (``reduce``)."""
        w = self.window
        w.started_in_backward += w.in_backward
        grads = [p.grad for p in b.params]
        for p, g in zip(b.params, grads):
            w.used[id(p)] = g is not None
            p.grad = None  # the flat copy holds it now
        w.handles[b.index] = self.reduce(b, b.flatten(grads))

    def reduce(self, b: Bucket, flat):
        """Start the collective of bucket ``b``'s flat gradient: the all-reduce (sum), or the comm hook."""
        if self._comm_hook is not None:
            state, hook = self._comm_hook
            return hook(state, GradBucket(b.index, flat, [p.shape for p in b.params], self.comm,
                                          self.start_collective, self.algorithm,
                                          is_last=b.index == len(self.buckets) - 1))
        return self.start_collective(all_reduce, flat, f"all-reduce b{b.index}", op="sum",
                                     algorithm=self.algorithm)

    def start_collective(self, fn, x, label, **kw):
        """Start ``fn(comm, x, **kw)`` on the async worker, timed there (with the caller's tracer)."""
        tracer, events = current(), self.window.events

        def timed(c, x, label, **kw):
            t0 = self.now()
            with tracer.span(label, "collective") if tracer else contextlib.nullcontext():
                out = fn(c, x, **kw)
            events.append((label, "comm", t0, self.now()))
            return out
        timed.__name__ = getattr(fn, "__name__", "collective")
        return start_async(self.comm, timed, x, label, **kw)

    def register_comm_hook(self, state, hook) -> None:
        """Send each bucket through ``hook(state, bucket) -> Handle`` (its sum over ranks) instead of the
        all-reduce: PyTorch's contract, hooks in ``compress/``. Once, before the first backward."""
        if self._comm_hook is not None or self.window.handles:
            raise RuntimeError(f"rank {self.comm.rank}: register_comm_hook once, before the first backward "
                               f"(a hook is {'already registered' if self._comm_hook else 'too late now'})")
        self._comm_hook = (state, hook)

    # -- at the end: wait and divide --------------------------------------------------------------
    def wait_gradients(self):
        """Start the buckets that never completed, wait, average (also after an all-``no_sync`` window)."""
        w = self.window
        if not w.syncing:
            raise RuntimeError(f"rank {self.comm.rank}: wait_gradients() inside no_sync(): the "
                               "gradients of this window have not been communicated")
        if w.micro == 0 and not w.hooked:
            return  # no backward since the last sync: nothing to communicate
        if w.weighted and w.count is None:  # all inside no_sync(): queue the count first, as backward would
            self._start_count(w)
        for b in self.buckets[w.next:]:
            self.start_bucket(b)
        divisor = self._divisor(w)
        for b in self.buckets:
            self.finish(b, w.handles[b.index].wait(), divisor)
        if self.find_unused:
            self._drop_unused(w)
        self.last_window, self.window = w, self._new_window()

    def finish(self, b: Bucket, total, divisor: float):
        """Bucket ``b``'s sum arrived: divide, hand out views as ``p.grad``."""
        for p, v in zip(b.params, b.views(total, divisor)):
            p.grad = v

    def _divisor(self, w: SyncWindow) -> float:
        if w.count is not None:
            n = float(w.count.wait()[0])
            if n <= 0:
                raise ValueError(f"rank {self.comm.rank}: the global batch is empty (Σ n_samples = 0)")
            return n
        return float(self.comm.size * max(w.micro, 1))  # plain loss.backward(): PyTorch's mean over ranks

    def _drop_unused(self, w: SyncWindow):
        used = np.array([w.used.get(id(p), False) for p in self.params], np.int64)
        anywhere = all_reduce(self.comm, used, op="max")
        for p, u in zip(self.params, anywhere):
            if not u:
                p.grad = None

    @property
    def started_in_backward(self) -> int:
        """Buckets of the last window (the open one once it ran) whose collective began in backward."""
        w = self.window
        if w.micro or w.hooked or self.last_window is None:
            return w.started_in_backward
        return self.last_window.started_in_backward

    @property
    def events(self) -> list:
        """(name, "backward"|"comm", t0, t1) of the last window (``trace.hidden_fraction`` reads them)."""
        return [] if self.last_window is None else self.last_window.events


DDP = DistributedDataParallel
