"""ZeRO (Rajbhandari et al. 2020): data parallelism that shards the training state instead of copying it.

Every gradient bucket (see ``minidist.parallel.data.ddp``) is a flat array; rank r *owns* the slice
``Bucket.shard(r, N)`` of each (``np.array_split``, what ``reduce_scatter``/``all_gather`` use).
The optimizer (any ``minidist.nn.optim`` optimizer, made by ``optimizer(shard_params)``) only sees the
owned slices, so its state is 1/N of DP's on every rank. ``ZeRO`` holds what every stage shares
(the shards, the reduce-scatter in place of DDP's all-reduce, the step, the sharded checkpoint);
each stage is its own class, read top to bottom after it (``ZeRO(..., stage=k)`` builds it):

* **1** (``ZeRO1``) -- optimizer state sharded. Backward runs as in single-process training,
  keeping the whole gradient; ``step`` reduce-scatters each bucket (rank r receives the sum of its
  slice only), updates its slice, and all-gathers the updated parameters. Bytes: Ψ + Ψ, the same
  2Ψ as DP.
* **2** (``ZeRO2``) -- gradients sharded too. The reduce-scatter of a bucket starts from the
  backward hook as soon as the bucket is complete (as DDP's all-reduce does) and the full gradient
  is dropped: a rank keeps only its slice. Same bytes as stage 1.
* **3** (``ZeRO3``) -- parameters sharded too. Each *unit* (default: the model's top-level layers)
  keeps only its slice; a forward wrapper on the unit (the ``"zero3"`` position of ``Module``'s
  stack) calls ``_gather_unit``, which all-gathers the full parameters just before the unit's
  forward, and ``_release_unit``, which frees them right after. Ops save parameters for backward
  (``linear`` keeps its weight): a ``saved_tensors_hooks`` pack turns them into references, and
  the unpack in backward all-gathers the unit again; it is freed when all its gradients are done.
  Bytes: Ψ (forward gathers) + Ψ (backward gathers) + Ψ (reduce-scatter) = 3Ψ, 1.5x DP -- less a
  unit whose backward needs no weights and so is not gathered again (a GPT's Embed: a lookup's
  gradient needs the ids).

Per-rank memory (``memory_arrays``, read by ``minidist.memory.MemoryAccountant.report``) follows
``minidist.memory.zero_formula``. Loss weighting, ``backward(loss, n_samples)`` and ``no_sync`` are
DDP's (with ``no_sync`` full gradients are accumulated locally and reduced on the last micro-step).
"""

from __future__ import annotations

import numpy as np

from minidist.autograd.tensor import current_saved_tensors_hooks, saved_tensors_hooks
from minidist.comm import all_gather, all_reduce, reduce_scatter
from minidist.comm.collectives import split_sizes
from minidist.nn.module import Parameter
from minidist.parallel.compose import check_compatible
from minidist.parallel.data.ddp import Bucket, DistributedDataParallel, build_buckets
from minidist.parallel.memory.recompute import recomputing_depth


class _ParamRef:
    """What the stage-3 pack hook saves instead of a gathered parameter array."""

    __slots__ = ("param", "unit")

    def __init__(self, param, unit):
        self.param, self.unit = param, unit


def all_gather_flat(comm, shard, numel: int):
    """The flat array of ``numel`` elements whose ``np.array_split`` part r is rank r's ``shard``:
    ``minidist.comm.all_gather`` with the part sizes every rank knows (no shape headers)."""
    return all_gather(comm, shard, axis=0, sizes=split_sizes(numel, comm.size))


def _units_of(module) -> list:
    children = module.children()
    return children if children and not module._params else [module]


class ZeRO(DistributedDataParallel):
    """``ZeRO(model, comm, lambda ps: AdamW(ps, lr=1e-3), stage=2)``; train with
    ``zero.backward(loss, n_samples)`` and ``zero.step()`` (which syncs, updates, gathers, zeroes).

    ``ZeRO(..., stage=k)`` builds the stage's own class (``ZeRO1``, ``ZeRO2``, ``ZeRO3``); this base
    is what every stage shares: the owned slices of each bucket (``shards``) and the optimizer over
    them, the reduce-scatter that replaces DDP's all-reduce, the step, the sharded checkpoint.
    ``units`` (stage 3): modules gathered and freed as one; every trainable parameter must belong to
    exactly one unit. Frozen parameters stay replicated. ``full_parameters()`` gives the whole model.
    """

    stage = 0  # set by each stage's class

    def __new__(cls, module, comm, optimizer, stage: int = 2, *args, **kwargs):
        if cls is ZeRO:
            stages = {1: ZeRO1, 2: ZeRO2, 3: ZeRO3}
            if stage not in stages:
                raise ValueError(f"rank {comm.rank}: ZeRO stage must be 1, 2 or 3, got {stage!r}")
            cls = stages[stage]
        return super().__new__(cls)

    def __init__(self, module, comm, optimizer, stage: int | None = None, bucket_bytes: float = 4 << 20,
                 units=None, broadcast_from: int | None = 0):
        if stage is not None and stage != self.stage:
            raise ValueError(f"rank {comm.rank}: {type(self).__name__} is stage {self.stage}, "
                             f"got stage={stage}")
        self.technique = f"zero{self.stage}"
        check_compatible(module, self.technique)  # before units are looked for: a pipeline stage has none
        self._setup_units(module, units, comm)
        super().__init__(module, comm, bucket_bytes=bucket_bytes, algorithm="ring",
                         broadcast_from=broadcast_from)
        self.shards = []
        for b in self.buckets:
            lo, hi = b.shard(comm.rank, comm.size)
            flat = b.flatten([p.data for p in b.params])
            shard = flat[lo:hi]
            self.shards.append(Parameter(shard.copy() if b.params[0].backend.inplace else shard))  # a view
        self.optimizer = optimizer(self.shards)

    def _setup_units(self, module, units, comm) -> None:
        """The units a model is gathered by (stage 3; the other stages keep them only to report)."""
        self.units = list(units) if units is not None else _units_of(module)
        self.gather_log: list[tuple] = []  # (unit, "forward"|"backward"): stage 3's gathers

    # -- gradients: reduce-scatter instead of all-reduce -----------------------------------------
    def _launch(self, b: Bucket, flat):
        """Start bucket ``b``'s reduce-scatter (``DistributedDataParallel._start`` flattened it)."""
        return self._async(reduce_scatter, flat, f"reduce-scatter b{b.index}", op="sum")

    def _complete(self, b: Bucket, mine, divisor: float):
        """This rank's slice of bucket ``b``'s summed gradient arrived: it is its shard's gradient."""
        self.shards[b.index].grad = mine / divisor if divisor != 1 else mine

    # -- the step --------------------------------------------------------------------------------
    def step(self):
        """Finish the gradient sync, update the owned slices, share the new parameters, zero grads."""
        self.wait_gradients()
        self.update()

    def update(self):
        """The second half of ``step`` (after ``wait_gradients``): optimizer step on the owned slices,
        then every rank gets the new parameters (``_share_parameters``), zero grads."""
        self.optimizer.step()
        self._share_parameters()
        self.zero_grad()

    def _share_parameters(self) -> None:
        """Stages 1 and 2: all-gather every bucket, so each rank holds the whole model again."""
        for b in self.buckets:
            self._gather_bucket(b)

    def _full_views(self, b: Bucket) -> list:
        """All-gather bucket ``b``'s slices (collective) and view the flat result as its parameters."""
        return b.views(all_gather_flat(self.comm, self.shards[b.index].data, b.numel))

    def _gather_bucket(self, b: Bucket) -> None:
        """Every parameter of bucket ``b`` whole again on this rank (collective)."""
        for p, v in zip(b.params, self._full_views(b)):
            p.data = v

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip the *global* gradient norm (call after ``wait_gradients``, before ``update``): each rank
        holds a slice of the gradient, so the squared norms of the slices are summed over ranks."""
        local = sum(float((s.grad.astype("float64") ** 2).sum()) for s in self.shards if s.grad is not None)
        norm = float(np.sqrt(all_reduce(self.comm, np.array([local]), op="sum")[0]))
        if norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            for s in self.shards:
                if s.grad is not None:
                    s.grad = (s.grad * scale).astype(s.grad.dtype)
        return norm

    def zero_grad(self):
        self.module.zero_grad()
        for s in self.shards:
            s.grad = None

    # -- a sharded checkpoint: each rank saves and restores only what it owns -------------------
    def state_dict(self) -> dict:
        """This rank's part of the training state: its slices of the parameters (at stage 3 the only
        copy there is), its optimizer state, and the layout needed to check them on load."""
        return {"stage": self.stage, "rank": self.comm.rank, "size": self.comm.size,
                "numels": [b.numel for b in self.buckets],
                "shards": [np.array(s.backend.to_host(s.data)) for s in self.shards],
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, sd: dict):
        """Restore what ``state_dict`` saved on this rank (collective: stages 1 and 2 share the
        restored slices so every replica holds the full parameters again)."""
        want = {"stage": self.stage, "rank": self.comm.rank, "size": self.comm.size,
                "numels": [b.numel for b in self.buckets]}
        got = {k: sd.get(k) for k in want}
        if got != want:
            raise ValueError(f"rank {self.comm.rank}: this ZeRO checkpoint shard was saved with {got}, "
                             f"but this run has {want}; load each rank's own shard, with the same "
                             "model, stage and world size")
        for shard, arr in zip(self.shards, sd["shards"]):
            shard.data = shard.backend.from_host(np.array(arr, dtype=shard.dtype))
        self.optimizer.load_state_dict(sd["optimizer"])
        self._share_parameters()
        return self

    # -- reading the model -----------------------------------------------------------------------
    def full_parameters(self) -> dict:
        """Name -> full parameter array (every rank holds them at stages 1 and 2)."""
        return {n: p.data for n, p in self.module.named_parameters()}

    def memory_arrays(self) -> dict:
        """What this rank holds between steps, for ``MemoryAccountant.report``."""
        params = self.module.parameters()
        opt = [v for st in self.optimizer.state for v in st.values() if hasattr(v, "nbytes")]
        grads = [s.grad for s in self.shards] + [p.grad for p in params]
        return {"params": self._held_parameters(), "grads": grads, "optimizer_state": opt}

    def _held_parameters(self) -> list:
        return [p.data for p in self.module.parameters()]


class ZeRO1(ZeRO):
    """Stage 1: only the optimizer state is sharded. Backward keeps the whole gradient as in serial
    training (the hooks only note that it ran); ``step`` reduce-scatters every bucket, updates this
    rank's slice, all-gathers the parameters. On an in-place backend the flat bucket becomes the
    gradient storage (the ``p.grad`` are views of it) and the reduced slice is written back into it."""

    stage = 1

    def __init__(self, *args, **kwargs):
        self._flats: dict[int, object] = {}
        super().__init__(*args, **kwargs)

    def _on_grad_ready(self, p):
        self._hooked = True  # stage 1 communicates only in step()

    def _launch(self, b: Bucket, flat):
        if b.params[0].backend.inplace:
            self._flats[b.index] = flat
            for p, v in zip(b.params, b.views(flat)):
                p.grad = v
        return super()._launch(b, flat)

    def _complete(self, b: Bucket, mine, divisor: float):
        super()._complete(b, mine, divisor)
        flat = self._flats.pop(b.index, None)
        if flat is not None:  # our reduced slice, back into the full gradient buffer
            lo, hi = b.shard(self.comm.rank, self.comm.size)
            flat[lo:hi] = self.shards[b.index].grad
            self.shards[b.index].grad = flat[lo:hi]

    def zero_grad(self):
        super().zero_grad()
        self._flats.clear()


class ZeRO2(ZeRO):
    """Stage 2: gradients sharded too. DDP's hooks start each bucket's collective as soon as the
    bucket is complete -- here a reduce-scatter -- and the full gradient is dropped: a rank keeps
    only its slice. Everything it needs is the shared base."""

    stage = 2


class ZeRO3(ZeRO):
    """Stage 3: parameters sharded too. Each unit keeps only its slices between uses; a forward
    wrapper at the ``"zero3"`` position of the unit's ``Module`` wrapper stack gathers it before its
    forward and releases it after, its saved-tensor hook keeps references instead of parameters
    (backward gathers again), and the unit is released once backward produced all its gradients.
    Buckets: one per unit (and dtype), in backward order. ``prefetch=True``: when unit u's forward
    starts, unit u+1's all-gather starts on the async worker, so its bytes overlap u's compute
    (FSDP's forward prefetch); same results, same bytes, one more unit in flight."""

    stage = 3

    def _setup_units(self, module, units, comm) -> None:
        super()._setup_units(module, units, comm)
        self._unit_pending: dict[int, int] = {}
        self.gathered: set[int] = set()
        self.prefetch_log: list[int] = []  # units whose gather started early (``prefetch=True``)

    def __init__(self, *args, prefetch: bool = False, **kwargs):
        self.prefetch = prefetch  # start gathering unit u+1 when unit u's forward starts
        self._prefetched: dict[int, list] = {}  # unit -> handles of its buckets' all-gathers in flight
        super().__init__(*args, **kwargs)
        self._wrapper_handles = [self.units[u].register_forward_wrapper(self._wrapper(u), "zero3", "ZeRO-3")
                                 for u in range(len(self.units))]
        for u in range(len(self.units)):
            self._release_unit(u)

    def _make_buckets(self, bucket_bytes) -> list[Bucket]:
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
        buckets, self._unit_of = [], {}
        for u in reversed(range(len(self.units))):
            params = [p for p in self.units[u].parameters() if p.requires_grad]
            for b in build_buckets(reversed(params), float("inf")):
                b.index = len(buckets)
                buckets.append(b)
                self._unit_of[b.index] = u
        self._unit_buckets = {u: [b for b in buckets if self._unit_of[b.index] == u]
                              for u in range(len(self.units))}
        return buckets

    def _on_grad_ready(self, p):
        super()._on_grad_ready(p)
        u = self._unit_of[self._bucket_of[id(p)].index]
        self._unit_pending[u] -= 1
        if self._unit_pending[u] == 0:  # backward is done with this unit
            self._release_unit(u)

    def _share_parameters(self) -> None:
        """Nothing to share: the next forward gathers the new slices; free what is still gathered."""
        for u in sorted(self.gathered):
            self._release_unit(u)

    # -- gather before use, free after -------------------------------------------------------------
    def _gather_unit(self, u: int, phase: str = "backward"):
        if u in self.gathered:
            return
        self.gather_log.append((u, phase))
        handles = self._prefetched.pop(u, None)
        for i, b in enumerate(self._unit_buckets[u]):
            if handles is None:
                self._gather_bucket(b)
            else:  # started while the previous unit computed: usually arrived already
                for p, v in zip(b.params, b.views(handles[i].wait())):
                    p.data = v
        self.gathered.add(u)

    def _prefetch_unit(self, u: int) -> None:
        """Start all-gathering unit ``u`` on the async worker (collective; the same on every rank):
        its bytes travel while the current unit computes, and ``_gather_unit`` only waits. Costs one
        more unit of memory in flight; the bytes are the same (``u`` is gathered once either way)."""
        if u >= len(self.units) or u in self.gathered or u in self._prefetched:
            return
        self.prefetch_log.append(u)
        self._prefetched[u] = [self._async(all_gather_flat, self.shards[b.index].data.copy(),
                                           f"prefetch unit {u} b{b.index}", numel=b.numel)
                               for b in self._unit_buckets[u]]

    def update(self):
        for handles in self._prefetched.values():  # never used: drain before the shards change
            for h in handles:
                h.wait()
        self._prefetched.clear()
        super().update()

    def _release_unit(self, u: int):
        for b in self._unit_buckets[u]:
            xp = b.params[0].backend.xp
            empty = xp.zeros((), b.dtype)
            for p in b.params:
                p.data = xp.broadcast_to(empty, p.shape)  # right shape, one element of memory
        self.gathered.discard(u)

    def _wrapper(self, u: int):
        def wrapper(unit, inner, *args, **kwargs):
            return self._gathered_forward(u, inner, args, kwargs)
        return wrapper

    def _gathered_forward(self, u: int, inner, args, kwargs):
        """Gather unit ``u``, run ``inner`` with parameters saved as references, release."""
        self._gather_unit(u, "forward")
        if self.prefetch and not recomputing_depth():
            self._prefetch_unit(u + 1)
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
                self._gather_unit(s.unit)
                return s.param.data
            return outer[1](s[1]) if outer else s[1]

        try:
            with saved_tensors_hooks(pack, unpack):
                return inner(*args, **kwargs)
        finally:
            if not recomputing_depth():  # a recomputation's backward comes next and needs the unit
                self._release_unit(u)

    # -- reading the model -------------------------------------------------------------------------
    def full_parameters(self) -> dict:
        """Name -> full parameter array (collective: all-gathers every unit's slices)."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        out = {n: p.data for n, p in self.module.named_parameters() if not p.requires_grad}
        for b in self.buckets:
            out.update({names[id(p)]: v for p, v in zip(b.params, self._full_views(b))})
        return {n: out[n] for n in names.values()}

    def _held_parameters(self) -> list:
        frozen = [p.data for p in self.module.parameters() if not p.requires_grad]
        gathered = [p.data for u in self.gathered for b in self._unit_buckets[u] for p in b.params]
        return [s.data for s in self.shards] + frozen + gathered


def param_count(module) -> int:
    """Ψ: the number of trainable parameters."""
    return int(sum(p.size for p in module.parameters() if p.requires_grad))


__all__ = ["ZeRO", "ZeRO1", "ZeRO2", "ZeRO3", "all_gather_flat", "param_count"]
