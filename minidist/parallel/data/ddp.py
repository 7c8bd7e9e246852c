"""Data parallelism (DDP): every rank holds the whole model and a slice of the batch.

    ddp = DistributedDataParallel(model, comm, bucket_bytes=1 << 20)
    for micro in range(k):                                # gradient accumulation
        with ddp.no_sync() if micro < k - 1 else contextlib.nullcontext():
            ddp.backward(model.loss(x[micro], y[micro]), n_samples=len(x[micro]))
    ddp.wait_gradients()                                  # p.grad = the global-batch gradient
    opt.step()

What happens, by function:

* ``__init__``: ``check_same_model`` (an error on every rank, not a hang, if ranks disagree),
  ``broadcast_parameters`` from rank 0 (ranks may have been seeded differently), ``build_buckets``
  (gradients in reverse parameter order -- the order backward produces them -- cut into buckets of
  at most ``bucket_bytes``), and one post-accumulate-grad hook per parameter.
* ``_on_grad_ready`` (the hook, during backward): when every gradient of a bucket is complete the
  bucket is flattened and its all-reduce *started* (``all_reduce_async``) while backward goes on
  computing earlier layers: communication overlaps computation. Buckets start strictly in order,
  so every rank queues the same collectives in the same order.
* ``wait_gradients``: starts buckets that never completed (a parameter got no gradient on this
  rank: it contributes zeros), waits for every all-reduce, and puts the averaged gradient in
  ``p.grad``.

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

import numpy as np

from minidist.accel import jax_engine
from minidist.accel.backend import host_scalar
from minidist.comm import all_reduce, all_reduce_async, broadcast
from minidist.comm.collectives import split_sizes
from minidist.comm.handles import start_async
from minidist.parallel.compose import check_compatible, claim
from minidist.parallel.data.compress.bucket import GradBucket
from minidist.trace import OverlapRecorder, hidden_fraction

# -- buckets -------------------------------------------------------------------------------------

@jax_engine.pure  # on JAX one compiled call, not a zeros/reshape program per parameter and a concat
def _flatten(xp, arrays, sizes, dtype):
    return xp.concatenate([xp.zeros(n, dtype) if a is None else a.reshape(-1) for a, n in zip(arrays, sizes)])


@jax_engine.pure  # on JAX one compiled call, not a slice and a reshape program per parameter
def _views(flat, offsets, sizes, shapes, divisor=None) -> list:
    if divisor is not None:  # the average of a summed gradient (in the same call: no divide program on JAX)
        flat = flat / divisor
    return [flat[o:o + n].reshape(s) for o, n, s in zip(offsets, sizes, shapes)]


class Bucket:
    """Parameters of one dtype whose gradients travel in one message, as one flat array."""

    def __init__(self, index: int, params: list):
        self.index, self.params = index, params
        self.sizes = [p.size for p in params]
        self.offsets = [int(o) for o in np.cumsum([0] + self.sizes[:-1])]
        self.numel = int(sum(self.sizes))
        self.dtype = params[0].dtype
        self.pending = len(params)  # gradients still to come in this backward

    def flatten(self, arrays):
        """One flat array of the bucket's parameters' arrays (None -> zeros), in bucket order."""
        return _flatten(self.params[0].backend.xp, list(arrays), tuple(self.sizes), self.dtype)

    def views(self, flat, divisor: float = 1.0) -> list:
        """The inverse of ``flatten``: per-parameter views of ``flat`` (divided by ``divisor``, a new
        array then) in their shapes. The divisor travels as a host scalar of ``flat``'s dtype (what
        NumPy makes of a Python float there): an argument of the compiled call on JAX, so a weighted
        batch or a short last one divides by a new number without compiling a new program."""
        scalar = None if divisor == 1 else host_scalar(divisor, flat)
        return _views(flat, tuple(self.offsets), tuple(self.sizes), tuple(p.shape for p in self.params),
                      scalar)

    def shard(self, rank: int, size: int) -> tuple[int, int]:
        """[lo, hi) of the flat bucket rank ``rank`` owns: ``np.array_split`` of numel into size parts
        (what ``reduce_scatter`` and ``all_gather`` use)."""
        sizes = split_sizes(self.numel, size)
        lo = sum(sizes[:rank])
        return lo, lo + sizes[rank]

    def __repr__(self):
        return f"<Bucket {self.index}: {len(self.params)} params, {self.numel} x {self.dtype}>"


def build_buckets(params, bucket_bytes: float) -> list[Bucket]:
    """Cut ``params`` (in the given order) into runs of one dtype and at most ``bucket_bytes`` bytes
    (a parameter larger than that gets a bucket of its own)."""
    buckets, cur, cur_bytes = [], [], 0
    for p in params:
        nbytes = p.size * np.dtype(p.dtype).itemsize
        if cur and (p.dtype != cur[0].dtype or cur_bytes + nbytes > bucket_bytes):
            buckets.append(Bucket(len(buckets), cur))
            cur, cur_bytes = [], 0
        cur.append(p)
        cur_bytes += nbytes
    if cur:
        buckets.append(Bucket(len(buckets), cur))
    return buckets


# -- start-up checks -----------------------------------------------------------------------------

def model_signature(module) -> list[tuple]:
    return [(name, tuple(p.shape), str(p.dtype), bool(p.requires_grad))
            for name, p in module.named_parameters()]


def check_same_model(comm, module) -> None:
    """Every rank must wrap the same architecture: compare (name, shape, dtype, requires_grad) lists.

    Raises ValueError on *every* rank (they all see all signatures), naming the ranks that differ,
    before any gradient collective could pair up mismatched buffers or hang.
    """
    sigs = comm.allgather_obj(model_signature(module))
    bad = [r for r, s in enumerate(sigs) if s != sigs[0]]
    if not bad:
        return
    r = bad[0]
    a, b = sigs[0], sigs[r]
    diff = next((f"rank 0 has {x}, rank {r} has {y}" for x, y in zip(a, b) if x != y),
                f"rank 0 has {len(a)} parameters, rank {r} has {len(b)}")
    raise ValueError(f"rank {comm.rank}: data-parallel ranks disagree on the model (ranks {bad} differ "
                     f"from rank 0): first difference: {diff}. Build the same model on every rank.")


def broadcast_parameters(comm, module, root: int = 0) -> None:
    """Make every rank's parameters (frozen ones too) equal to ``root``'s: one broadcast per dtype."""
    for b in build_buckets(module.parameters(), float("inf")):
        flat = broadcast(comm, b.flatten([p.data for p in b.params]), root=root)
        for p, v in zip(b.params, b.views(flat)):
            p.data = v


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
        self.buckets = self._make_buckets(bucket_bytes)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._sync = True
        self._comm_hook = None  # (state, hook) of register_comm_hook; None: the plain all-reduce
        self.started_in_backward = 0  # buckets of the last window whose collective began during backward
        self.timeline = OverlapRecorder()  # when backward and each collective ran (minidist.trace)
        self._reset_window()
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        claim(module, self.technique, comm)

    def _make_buckets(self, bucket_bytes) -> list[Bucket]:
        return build_buckets(reversed(self.params), bucket_bytes)

    # -- the module ----------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def parameters(self):
        return self.module.parameters()

    def zero_grad(self):
        self.module.zero_grad()

    # -- accumulation --------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside this block only accumulates ``p.grad`` locally (no communication);
        the first backward after it syncs everything accumulated."""
        prev, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = prev

    def _reset_window(self):
        self._weight = 0.0        # Σ n_samples of this rank since the last sync
        self._weighted = False    # did backward() get n_samples?
        self._micro = 0           # backward passes since the last sync
        self._weight_handle = None
        self._handles: dict[int, object] = {}
        self._next = 0            # the next bucket to start (buckets start in order)
        self._used: dict[int, bool] = {}
        self._in_backward = False
        self._hooked = False      # did any gradient hook fire (also for plain loss.backward())?
        self._synced = False      # has a syncing backward run? (then wait_gradients must come next)
        for b in self.buckets:
            b.pending = len(b.params)

    def backward(self, loss, n_samples: int | None = None):
        """``loss.backward()`` for a loss that is the *mean* over this rank's ``n_samples`` terms
        (weights the gradient by n_samples; see the module docstring). A per-token mean with ignored
        targets (``GPT.loss``, ``ops.cross_entropy``) averages over the valid tokens: pass their
        count, ``int((y != -1).sum())``, not the rows. All ranks either pass n_samples or none does."""
        if n_samples is not None:
            if n_samples < 0:
                raise ValueError(f"rank {self.comm.rank}: n_samples must be >= 0, got {n_samples}")
            self._weighted = True
        if self._synced:
            raise RuntimeError(f"rank {self.comm.rank}: backward() after a syncing backward without "
                               "wait_gradients() in between; wrap the earlier micro-steps in no_sync()")
        if self._micro == 0:
            self.started_in_backward = 0
        w = 1.0 if n_samples is None else float(n_samples)
        self._weight += w
        self._micro += 1
        if self._sync and self._weighted:  # queued first: the worker runs it before any bucket
            self._start_count()
        seed = loss.backend.from_host(np.full(loss.data.shape, w, dtype=loss.dtype))  # (JAX: no program)
        self._in_backward = True
        try:
            with self.timeline.backward(record=self._sync):  # a sync window: its last backward
                loss.backward(seed)
        finally:
            self._in_backward = False
        self._synced = self._sync

    def _start_count(self):
        """Queue the all-reduce of Σ n_samples (this window's divisor N) on the async worker."""
        self._weight_handle = all_reduce_async(self.comm, np.array([self._weight]), op="sum")

    # -- the hooks: start bucket all-reduces during backward ---------------------------------
    def _on_grad_ready(self, p):
        self._hooked = True
        if not self._sync:
            return
        b = self._bucket_of[id(p)]
        b.pending -= 1
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._start(self.buckets[self._next])
            self._next += 1

    def _start(self, b: Bucket):
        """Flatten bucket ``b``'s gradients and start its collective (``_launch``)."""
        self.started_in_backward += self._in_backward
        grads = [p.grad for p in b.params]
        for p, g in zip(b.params, grads):
            self._used[id(p)] = g is not None
            p.grad = None  # the flat copy holds it now
        self._handles[b.index] = self._launch(b, b.flatten(grads))

    def _launch(self, b: Bucket, flat):
        if self._comm_hook is not None:
            state, hook = self._comm_hook
            return hook(state, GradBucket(b.index, flat, [p.shape for p in b.params], self.comm, self._async,
                                          self.algorithm, is_last=b.index == len(self.buckets) - 1))
        return self._async(all_reduce, flat, f"all-reduce b{b.index}", op="sum", algorithm=self.algorithm)

    def register_comm_hook(self, state, hook) -> None:
        """Send each bucket through ``hook(state, bucket) -> Handle`` instead of the all-reduce
        (PyTorch's contract; built-in hooks, e.g. PowerSGD, in ``minidist.parallel.data.compress``). The
        handle gives the bucket summed over ranks; DDP divides it by the batch as usual. Register once,
        before the first backward."""
        if self._comm_hook is not None or self._handles:
            raise RuntimeError(f"rank {self.comm.rank}: register_comm_hook once, before the first backward "
                               f"(a hook is {'already registered' if self._comm_hook else 'too late now'})")
        self._comm_hook = (state, hook)

    def _async(self, fn, x, label, **kw):
        """Start collective ``fn(comm, x, **kw)`` on the async worker, timed by ``self.timeline``."""
        return start_async(self.comm, self.timeline.timed(fn), x, label, **kw)

    def _complete(self, b: Bucket, total, divisor: float):
        """Bucket ``b``'s summed gradient arrived: divide and hand out views as ``p.grad``."""
        for p, v in zip(b.params, b.views(total, divisor)):
            p.grad = v

    def _divisor(self) -> float:
        if self._weight_handle is not None:
            n = float(self._weight_handle.wait()[0])
            if n <= 0:
                raise ValueError(f"rank {self.comm.rank}: the global batch is empty (Σ n_samples = 0)")
            return n
        if self._micro == 0:  # plain loss.backward() (not ddp.backward): PyTorch's mean over ranks
            return float(self.comm.size)
        return float(self.comm.size * self._micro)

    def wait_gradients(self):
        """Finish the gradient sync: start buckets that never completed, wait, average.

        Also right after a window whose every micro-step ran inside ``no_sync()`` (then it starts
        the count of samples and every bucket here)."""
        if not self._sync:
            raise RuntimeError(f"rank {self.comm.rank}: wait_gradients() inside no_sync(): the "
                               "gradients of this window have not been communicated")
        if self._micro == 0 and not self._hooked:
            return  # no backward since the last sync: nothing to communicate
        if self._weighted and self._weight_handle is None:
            # every micro-step ran inside no_sync(): no syncing backward queued the count, so no
            # bucket has started either -- queue it now, first, as a syncing backward would have
            self._start_count()
        for b in self.buckets[self._next:]:
            self._start(b)
        divisor = self._divisor()
        for b in self.buckets:
            self._complete(b, self._handles[b.index].wait(), divisor)
        if self.find_unused:
            self._drop_unused()
        self.timeline.close_window()
        self._reset_window()

    def _drop_unused(self):
        used = np.array([self._used.get(id(p), False) for p in self.params], np.int64)
        anywhere = all_reduce(self.comm, used, op="max")
        for p, u in zip(self.params, anywhere):
            if not u:
                p.grad = None

    @property
    def events(self) -> list:
        """(name, "backward"|"comm", t0, t1) of the last synced window (``trace.OverlapRecorder``)."""
        return self.timeline.events

    def hidden_fraction(self) -> float:
        """Share of the last window's communication that overlapped its backward."""
        return hidden_fraction(self.events)


DDP = DistributedDataParallel
