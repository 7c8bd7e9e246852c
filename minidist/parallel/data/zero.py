"""ZeRO (Rajbhandari et al. 2020): data parallelism that shards the training state instead of copying it.

``ZeRO(model, comm, optimizer, stage=k)`` builds stage k's class; each is read top to bottom by its
own methods, on the shared machinery of ``minidist.parallel.data.sharded`` (rank r owns the slice
``Bucket.shard(r, N)`` of every flat gradient bucket; the optimizer sees only those slices, so its
state is 1/N of DP's):

* **1** (``ZeRO1``) -- optimizer state sharded. Backward runs as in single-process training,
  keeping the whole gradient (``grad_ready`` starts nothing); ``step`` reduce-scatters each bucket
  (rank r receives the sum of its slice only), updates its slice, and all-gathers the updated
  parameters (``share_parameters``). Bytes: Ψ + Ψ, the same 2Ψ as DP.
* **2** (``ZeRO2``) -- gradients sharded too. DDP's hook starts each bucket's collective as soon as
  the bucket is complete -- here ``reduce`` is a reduce-scatter -- and ``finish`` keeps only this
  rank's slice: the full gradient is freed as backward goes. Same bytes as stage 1.
* **3** (``ZeRO3``) -- parameters sharded too. Each *unit* (default: the model's top-level layers)
  keeps only its slice; a forward wrapper on the unit (the ``"zero3"`` position of ``Module``'s
  stack) calls ``gather_unit``, which all-gathers the full parameters just before the unit's
  forward, and ``release_unit``, which frees them right after. Ops save parameters for backward
  (``linear`` keeps its weight): a ``saved_tensors_hooks`` pack turns them into references, and
  the unpack in backward all-gathers the unit again; it is freed when all its gradients are done.
  Bytes: Ψ (forward gathers) + Ψ (backward gathers) + Ψ (reduce-scatter) = 3Ψ, 1.5x DP -- less a
  unit whose backward needs no weights and so is not gathered again (a GPT's Embed: a lookup's
  gradient needs the ids).

Per-rank memory (``memory_arrays``, read by ``minidist.nn.footprint.MemoryAccountant.report``) follows
``minidist.nn.footprint.zero_formula``. Loss weighting, ``backward(loss, n_samples)`` and ``no_sync`` are
DDP's (with ``no_sync`` full gradients are accumulated locally and reduced on the last micro-step).
"""

from __future__ import annotations

from minidist.autograd.tensor import current_saved_tensors_hooks, saved_tensors_hooks
from minidist.parallel.data.buckets import Bucket, build_buckets
from minidist.parallel.data.sharded import ShardedDataParallel, all_gather_flat, param_count
from minidist.parallel.memory.recompute import recomputing_depth


def ZeRO(module, comm, optimizer, stage: int = 2, bucket_bytes: float = 4 << 20, **kwargs):
    """``ZeRO(model, comm, lambda ps: AdamW(ps, lr=1e-3), stage=2)``: the stage's class (``ZeRO1``,
    ``ZeRO2``, ``ZeRO3``); train with ``zero.backward(loss, n_samples)`` and ``zero.step()`` (which
    syncs, updates, gathers, zeroes). Keywords: ``units`` and ``broadcast_from`` (every stage),
    ``prefetch`` (stage 3)."""
    stages = {1: ZeRO1, 2: ZeRO2, 3: ZeRO3}
    if stage not in stages:
        raise ValueError(f"rank {comm.rank}: ZeRO stage must be 1, 2 or 3, got {stage!r}")
    return stages[stage](module, comm, optimizer, bucket_bytes=bucket_bytes, **kwargs)


class ZeRO1(ShardedDataParallel):
    """Stage 1: only the optimizer state is sharded. Backward keeps the whole gradient as in serial
    training; ``step`` reduce-scatters every bucket, updates this rank's slice, all-gathers the
    parameters. On an in-place backend the flat bucket becomes the gradient storage (the ``p.grad``
    are views of it) and the reduced slice is written back into it."""

    stage, technique = 1, "zero1"

    def __init__(self, *args, **kwargs):
        self._flats: dict[int, object] = {}  # bucket index -> its flat gradient (in-place backends)
        super().__init__(*args, **kwargs)

    def grad_ready(self, p):
        """Backward only accumulates: stage 1 communicates in ``step`` (``wait_gradients`` starts
        every bucket there)."""
        self.window.hooked = True

    def reduce(self, b: Bucket, flat):
        """Reduce-scatter the whole accumulated gradient of bucket ``b``, keeping the full buffer."""
        if b.params[0].backend.inplace:
            self._flats[b.index] = flat
            for p, v in zip(b.params, b.views(flat)):
                p.grad = v
        return self.reduce_scatter(b, flat)

    def finish(self, b: Bucket, mine, divisor: float):
        """My slice of the summed gradient steps my optimizer shard (and goes back into the buffer)."""
        self.keep_my_slice(b, mine, divisor)
        flat = self._flats.pop(b.index, None)
        if flat is not None:
            lo, hi = b.shard(self.comm.rank, self.comm.size)
            flat[lo:hi] = self.shards[b.index].grad
            self.shards[b.index].grad = flat[lo:hi]

    def share_parameters(self) -> None:
        """After my slice stepped: all-gather every bucket, so each rank holds the whole model again."""
        self.all_gather_buckets()

    def zero_grad(self):
        super().zero_grad()
        self._flats.clear()


class ZeRO2(ShardedDataParallel):
    """Stage 2: gradients sharded too. DDP's hook starts each bucket's collective as soon as the
    bucket is complete -- a reduce-scatter -- and the full gradient is dropped: a rank keeps only
    its slice."""

    stage, technique = 2, "zero2"

    def reduce(self, b: Bucket, flat):
        """From the backward hook, once bucket ``b`` is complete: reduce-scatter it. ``start_bucket``
        has already dropped the parameters' full gradients; the flat copy lives only as long as the
        collective."""
        return self.reduce_scatter(b, flat)

    def finish(self, b: Bucket, mine, divisor: float):
        """Keep my slice of the summed gradient and nothing else of bucket ``b``."""
        self.keep_my_slice(b, mine, divisor)

    def share_parameters(self) -> None:
        """After my slice stepped: all-gather every bucket, so each rank holds the whole model again."""
        self.all_gather_buckets()


class _ParamRef:
    """What the stage-3 pack hook saves instead of a gathered parameter array."""

    __slots__ = ("param", "unit")

    def __init__(self, param, unit):
        self.param, self.unit = param, unit


class ZeRO3(ZeRO2):
    """Stage 3: parameters sharded too (gradients as stage 2). Each unit keeps only its slices
    between uses; a forward wrapper at the ``"zero3"`` position of the unit's ``Module`` wrapper stack
    gathers it before its forward and releases it after, its saved-tensor hook keeps references
    instead of parameters (backward gathers again), and the unit is released once backward produced
    all its gradients. Buckets: one per unit (and dtype), in backward order. ``prefetch=True``: when
    unit u's forward starts, unit u+1's all-gather starts on the async worker, so its bytes overlap
    u's compute (FSDP's forward prefetch); same results, same bytes, one more unit in flight."""

    stage, technique = 3, "zero3"

    def __init__(self, *args, prefetch: bool = False, **kwargs):
        self.prefetch = prefetch  # start gathering unit u+1 when unit u's forward starts
        self._prefetched: dict[int, list] = {}  # unit -> handles of its buckets' all-gathers in flight
        self._unit_pending: dict[int, int] = {}  # unit -> gradients its backward has still to produce
        self.gathered: set[int] = set()
        self.prefetch_log: list[int] = []  # units whose gather started early (``prefetch=True``)
        super().__init__(*args, **kwargs)
        self._wrapper_handles = [self.units[u].register_forward_wrapper(self._wrapper(u), "zero3", "ZeRO-3")
                                 for u in range(len(self.units))]
        for u in range(len(self.units)):
            self.release_unit(u)

    def make_buckets(self, bucket_bytes) -> list[Bucket]:
        """One bucket per unit (and dtype), units in backward order: a unit's gradients travel together."""
        owner: dict[int, int] = {}
        for u, unit in enumerate(self.units):
            for p in unit.parameters():
                if id(p) in owner:
                    raise ValueError(f"rank {self.comm.rank}: ZeRO-3 unit {u} shares a parameter with unit "
                                     f"{owner[id(p)]}; each parameter must live in one unit "
                                     "(tie weights inside one unit, or use stage 1/2)")
                owner[id(p)] = u
        missing = [i for i, p in enumerate(self.params) if id(p) not in owner]
        if missing:
            raise ValueError(f"rank {self.comm.rank}: ZeRO-3: {len(missing)} trainable parameters belong to "
                             "no unit; pass units=[...] covering every parameter")
        buckets, self.unit_of = [], {}
        for u in reversed(range(len(self.units))):
            params = [p for p in self.units[u].parameters() if p.requires_grad]
            for b in build_buckets(reversed(params), float("inf")):
                b.index = len(buckets)
                buckets.append(b)
                self.unit_of[b.index] = u
        self._unit_buckets = {u: [b for b in buckets if self.unit_of[b.index] == u]
                              for u in range(len(self.units))}
        return buckets

    def grad_ready(self, p):
        """Stage 2's hook, and the unit is freed once backward has produced all its gradients."""
        super().grad_ready(p)
        u = self.unit_of[self._bucket_index[id(p)]]
        self._unit_pending[u] -= 1
        if self._unit_pending[u] == 0:
            self.release_unit(u)

    def share_parameters(self) -> None:
        """Nothing to share: the next forward gathers the new slices; free what is still gathered."""
        for u in sorted(self.gathered):
            self.release_unit(u)

    def update(self):
        for handles in self._prefetched.values():  # never used: drain before the shards change
            for h in handles:
                h.wait()
        self._prefetched.clear()
        super().update()

    # -- gather before use, free after -------------------------------------------------------------
    def gather_unit(self, u: int, phase: str = "backward"):
        """Unit ``u``'s parameters whole on this rank (collective; a no-op if they are)."""
        if u in self.gathered:
            return
        self.gather_log.append((u, phase))
        handles = self._prefetched.pop(u, None)
        for i, b in enumerate(self._unit_buckets[u]):
            if handles is None:
                self.gather_bucket(b)
            else:  # started while the previous unit computed: usually arrived already
                for p, v in zip(b.params, b.views(handles[i].wait())):
                    p.data = v
        self.gathered.add(u)

    def prefetch_unit(self, u: int) -> None:
        """Start all-gathering unit ``u`` on the async worker (collective; the same on every rank):
        its bytes travel while the current unit computes, and ``gather_unit`` only waits. Costs one
        more unit of memory in flight; the bytes are the same (``u`` is gathered once either way)."""
        if u >= len(self.units) or u in self.gathered or u in self._prefetched:
            return
        self.prefetch_log.append(u)
        self._prefetched[u] = [self.start_collective(all_gather_flat, self.shards[b.index].data.copy(),
                                                     f"prefetch unit {u} b{b.index}", numel=b.numel)
                               for b in self._unit_buckets[u]]

    def release_unit(self, u: int):
        """Free unit ``u``'s full parameters: each keeps its shape, holding one element."""
        for b in self._unit_buckets[u]:
            xp = b.params[0].backend.xp
            empty = xp.zeros((), b.dtype)
            for p in b.params:
                p.data = xp.broadcast_to(empty, p.shape)
        self.gathered.discard(u)

    def _wrapper(self, u: int):
        def wrapper(unit, inner, *args, **kwargs):
            return self._gathered_forward(u, inner, args, kwargs)
        return wrapper

    def _gathered_forward(self, u: int, inner, args, kwargs):
        """Gather unit ``u``, run ``inner`` with parameters saved as references, release."""
        self.gather_unit(u, "forward")
        if self.prefetch and not recomputing_depth():
            self.prefetch_unit(u + 1)
        # released again once backward has produced all the unit's gradients (or at step())
        self._unit_pending[u] = sum(len(b.params) for b in self._unit_buckets[u])
        mine = {id(p.data): p for b in self._unit_buckets[u] for p in b.params}
        outer = current_saved_tensors_hooks()

        def pack(a):
            p = mine.get(id(a))
            if p is not None and p.data is a:
                return _ParamRef(p, u)
            return (None, outer[0](a)) if outer else (None, a)

        def unpack(s):
            if isinstance(s, _ParamRef):
                self.gather_unit(s.unit)
                return s.param.data
            return outer[1](s[1]) if outer else s[1]

        try:
            with saved_tensors_hooks(pack, unpack):
                return inner(*args, **kwargs)
        finally:
            if not recomputing_depth():  # a recomputation's backward comes next and needs the unit
                self.release_unit(u)

    # -- reading the model -------------------------------------------------------------------------
    def full_parameters(self) -> dict:
        """Name -> full parameter array (collective: all-gathers every unit's slices)."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        out = {n: p.data for n, p in self.module.named_parameters() if not p.requires_grad}
        for b in self.buckets:
            out.update({names[id(p)]: v for p, v in zip(b.params, self.full_views(b))})
        return {n: out[n] for n in names.values()}

    def held_parameters(self) -> list:
        frozen = [p.data for p in self.module.parameters() if not p.requires_grad]
        gathered = [p.data for u in self.gathered for b in self._unit_buckets[u] for p in b.params]
        return [s.data for s in self.shards] + frozen + gathered


__all__ = ["ZeRO", "ZeRO1", "ZeRO2", "ZeRO3", "ShardedDataParallel", "all_gather_flat", "param_count"]
