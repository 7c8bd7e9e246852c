"""Data parallelism (DDP): every rank holds the whole model and a slice of the batch.

    ddp = DistributedDataParallel(model, comm, bucket_bytes=1 << 20)
    for micro in range(k):                                # gradient accumulation
        with ddp.no_sync() if micro < k - 1 else contextlib.nullcontext():
            ddp.backward(model.loss(x[micro], y[micro]), n_samples=len(x[micro]))
    ddp.wait_gradients()                                  # p.grad = the global-batch gradient
    opt.step()

What happens, by function:

* ``__init__``: ``check_same_model`` and ``broadcast_parameters`` from rank 0 (``replicas``),
  ``build_buckets`` (``buckets``: gradients in reverse parameter order -- the order backward produces
  them -- cut into buckets of at most ``bucket_bytes``), one post-accumulate-grad hook per parameter.
* ``backward``: seeds backward with this rank's weight and runs it; a ``SyncWindow`` holds what
  the window (every backward since the last sync) has done: its weight, the buckets ready, the
  collectives in flight. A fresh one is made after each sync.
* ``grad_ready`` (the hook, during backward) counts its bucket down in the window; each bucket
  complete now (in order) -> ``start_bucket`` flattens it and ``reduce`` *starts* its all-reduce on the async
  worker (``start_collective``) while backward goes on computing earlier layers: communication
  overlaps computation. Buckets start strictly in order, so every rank queues the same collectives
  in the same order.
* ``wait_gradients``: starts buckets that never completed (a parameter got no gradient on this
  rank: it contributes zeros), waits for every all-reduce, and ``finish`` puts the averaged gradient
  in ``p.grad``.

The timeline (``self.timeline``, a ``trace.OverlapRecorder``) is reached in three places only: the
backward span in ``backward``, each collective in ``start_collective``, the window's close in
``wait_gradients``. ZeRO (``minidist.parallel.data.zero``) replaces ``reduce`` and ``finish``.

**Averaging over the global batch.** The serial twin takes the mean loss over all N samples of the
global batch: ``g = (1/N) Σ_i ∇ℓ_i``. Rank r computes the mean over its own n_r samples,
``g_r = (1/n_r) Σ_{i∈r} ∇ℓ_i``, so ``g = Σ_r (n_r/N) g_r``: each rank's gradient must be weighted by
its share of the batch and then *summed* -- plain averaging over ranks (``Σ_r g_r / p``) is only
right when every n_r is equal. ``backward(loss, n_samples)`` seeds backward with n_r instead of 1
(so the hooks see n_r·g_r), the buckets are summed, and ``wait_gradients`` divides by N = Σ n_r
(one tiny all-reduce, queued before the buckets). With accumulation the same holds over
(rank, micro-step) pairs. Without ``n_samples`` every micro-batch weighs the same.

``n_samples`` is the count the loss is a mean *over*. ``GPT.loss`` averages over valid target
tokens (targets of -1 are ignored), so for it pass ``int((y != -1).sum())``: the rows ``len(y)``
are right only when every row has the same number of valid tokens (then the weights are proportional).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np

from minidist.comm import all_reduce, all_reduce_async
from minidist.comm.handles import start_async
from minidist.parallel.compose import check_compatible, claim
from minidist.parallel.data.buckets import Bucket, build_buckets
from minidist.parallel.data.compress.bucket import GradBucket
from minidist.parallel.data.replicas import broadcast_parameters, check_same_model, model_signature
from minidist.trace import OverlapRecorder, hidden_fraction

__all__ = ["DDP", "Bucket", "DistributedDataParallel", "SyncWindow", "broadcast_parameters", "build_buckets",
           "check_same_model", "model_signature"]

# -- one gradient-sync window --------------------------------------------------------------------

@dataclass(slots=True)
class SyncWindow:
    """What one gradient-sync window needs: every backward from one sync to the next (the micro-steps
    of accumulation; the last one syncs) and the collectives they started. Made fresh after a sync."""

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


def _seed(loss, weight: float):
    """The gradient backward starts from: ``weight`` everywhere, made on the host (JAX: no program)."""
    return loss.backend.from_host(np.full(loss.data.shape, weight, dtype=loss.dtype))


# -- DDP -----------------------------------------------------------------------------------------

class DistributedDataParallel:
    """Wrap ``module`` for data parallelism over ``comm`` (see the module docstring).

    ``bucket_bytes``: gradient bucket capacity. ``algorithm``: the all-reduce ("ring": 2(p-1)/p
    bytes per rank per byte of gradient). ``find_unused_parameters``: after the buckets, all-reduce
    one flag per parameter so that a parameter no rank produced a gradient for keeps ``grad=None``
    (exactly as the serial twin, where e.g. AdamW then skips it); otherwise it gets zeros.
    Frozen parameters (``requires_grad=False``) are broadcast at start and never communicated again.
    ``ignore``: a list of parameters DDP never averages (e.g. expert-parallel ones, which differ
    across ranks and are synced over their own group); with them pass ``broadcast_from=None``.
    """

    technique = "ddp"  # its name in the composition matrix (minidist.parallel.compose)

    def __init__(self, module, comm, bucket_bytes: float = 4 << 20, algorithm: str = "ring",
                 find_unused_parameters: bool = False, broadcast_from: int | None = 0, ignore=()):
        self.module, self.comm = module, comm
        self.algorithm, self.find_unused = algorithm, find_unused_parameters
        check_compatible(module, self.technique)
        check_same_model(comm, module)
        if broadcast_from is not None:
            broadcast_parameters(comm, module, broadcast_from)
        self.params = [p for p in module.parameters() if p.requires_grad and all(p is not q for q in ignore)]
        self.buckets = self.make_buckets(bucket_bytes)
        self._bucket_index = {id(p): b.index for b in self.buckets for p in b.params}
        self._comm_hook = None  # (state, hook) of register_comm_hook; None: the plain all-reduce
        self.timeline = OverlapRecorder()  # when backward and each collective ran (minidist.trace)
        self.window = self._new_window()
        self.last_window: SyncWindow | None = None  # the window wait_gradients closed last
        for p in self.params:
            p.register_post_accumulate_grad_hook(self.grad_ready)
        claim(module, self.technique, comm)

    def make_buckets(self, bucket_bytes) -> list[Bucket]:
        """Gradients in the order backward produces them (reverse parameter order), bucketed."""
        return build_buckets(reversed(self.params), bucket_bytes)

    def _new_window(self) -> SyncWindow:
        return SyncWindow([len(b.params) for b in self.buckets])

    # -- the module ----------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def parameters(self):
        return self.module.parameters()

    def zero_grad(self):
        self.module.zero_grad()

    # -- backward: weight, accumulate, sync on the window's last -------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside this block only accumulates ``p.grad`` locally (no communication);
        the first backward after it syncs everything accumulated."""
        w = self.window
        prev, w.syncing = w.syncing, False
        try:
            yield
        finally:
            w.syncing = prev

    def backward(self, loss, n_samples: int | None = None):
        """``loss.backward()`` for a loss that is the *mean* over this rank's ``n_samples`` terms
        (weights the gradient by n_samples; see the module docstring). A per-token mean with ignored
        targets (``GPT.loss``, ``ops.cross_entropy``) averages over the valid tokens: pass their
        count, ``int((y != -1).sum())``, not the rows. All ranks either pass n_samples or none does."""
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
        w.in_backward = True
        try:
            with self.timeline.backward(record=w.syncing):  # a sync window: its last backward
                loss.backward(_seed(loss, weight))
        finally:
            w.in_backward = False
        w.synced = w.syncing

    def _start_count(self, w: SyncWindow):
        """Queue the all-reduce of Σ n_samples (this window's divisor N) on the async worker."""
        w.count = all_reduce_async(self.comm, np.array([w.weight]), op="sum")

    # -- hook fires -> bucket ready -> start its collective -------------------------------------
    def grad_ready(self, p):
        """The post-accumulate-grad hook of every trainable parameter: count its bucket down and start
        every bucket that is complete now, in bucket order."""
        w = self.window
        w.hooked = True
        if not w.syncing:
            return
        w.pending[self._bucket_index[id(p)]] -= 1  # one more gradient of its bucket is complete
        while w.next < len(self.buckets) and w.pending[w.next] == 0:  # ready buckets start in order
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
        """Start collective ``fn(comm, x, **kw)`` on the async worker, timed by ``self.timeline``."""
        return start_async(self.comm, self.timeline.timed(fn), x, label, **kw)

    def register_comm_hook(self, state, hook) -> None:
        """Send each bucket through ``hook(state, bucket) -> Handle`` instead of the all-reduce
        (PyTorch's contract; built-in hooks, e.g. PowerSGD, in ``minidist.parallel.data.compress``). The
        handle gives the bucket summed over ranks; DDP divides it by the batch as usual. Register once,
        before the first backward."""
        if self._comm_hook is not None or self.window.handles:
            raise RuntimeError(f"rank {self.comm.rank}: register_comm_hook once, before the first backward "
                               f"(a hook is {'already registered' if self._comm_hook else 'too late now'})")
        self._comm_hook = (state, hook)

    # -- at the end: wait and divide --------------------------------------------------------------
    def wait_gradients(self):
        """Finish the gradient sync: start buckets that never completed, wait, average.

        Also right after a window whose every micro-step ran inside ``no_sync()`` (then it starts
        the count of samples and every bucket here)."""
        w = self.window
        if not w.syncing:
            raise RuntimeError(f"rank {self.comm.rank}: wait_gradients() inside no_sync(): the "
                               "gradients of this window have not been communicated")
        if w.micro == 0 and not w.hooked:
            return  # no backward since the last sync: nothing to communicate
        if w.weighted and w.count is None:
            # every micro-step ran inside no_sync(): no syncing backward queued the count, so no
            # bucket has started either -- queue it now, first, as a syncing backward would have
            self._start_count(w)
        for b in self.buckets[w.next:]:
            self.start_bucket(b)
        divisor = self._divisor(w)
        for b in self.buckets:
            self.finish(b, w.handles[b.index].wait(), divisor)
        if self.find_unused:
            self._drop_unused(w)
        self.timeline.close_window()
        self.last_window, self.window = w, self._new_window()

    def finish(self, b: Bucket, total, divisor: float):
        """Bucket ``b``'s summed gradient arrived: divide and hand out views as ``p.grad``."""
        for p, v in zip(b.params, b.views(total, divisor)):
            p.grad = v

    def _divisor(self, w: SyncWindow) -> float:
        if w.count is not None:
            n = float(w.count.wait()[0])
            if n <= 0:
                raise ValueError(f"rank {self.comm.rank}: the global batch is empty (Σ n_samples = 0)")
            return n
        if w.micro == 0:  # plain loss.backward() (not ddp.backward): PyTorch's mean over ranks
            return float(self.comm.size)
        return float(self.comm.size * w.micro)

    def _drop_unused(self, w: SyncWindow):
        used = np.array([w.used.get(id(p), False) for p in self.params], np.int64)
        anywhere = all_reduce(self.comm, used, op="max")
        for p, u in zip(self.params, anywhere):
            if not u:
                p.grad = None

    # -- what the last window did -----------------------------------------------------------------
    @property
    def started_in_backward(self) -> int:
        """Buckets of the last window whose collective began during backward (the open window's
        count once its first backward ran)."""
        w = self.window
        if w.micro or w.hooked or self.last_window is None:
            return w.started_in_backward
        return self.last_window.started_in_backward

    @property
    def events(self) -> list:
        """(name, "backward"|"comm", t0, t1) of the last synced window (``trace.OverlapRecorder``)."""
        return self.timeline.events

    def hidden_fraction(self) -> float:
        """Share of the last window's communication that overlapped its backward."""
        return hidden_fraction(self.events)


DDP = DistributedDataParallel
