"""ZeRO (Rajbhandari et al. 2020): data parallelism that shards the training state instead of copying it.

Every gradient bucket (see ``minidist.parallel.ddp``) is a flat array; rank r *owns* the slice
``Bucket.shard(r, N)`` of each (``np.array_split``, what ``reduce_scatter``/``all_gather`` use).
The optimizer (any ``minidist.optim`` optimizer, made by ``optimizer(shard_params)``) only sees the
owned slices, so its state is 1/N of DP's on every rank. Stage by stage:

* **1** -- optimizer state sharded. Backward runs as in single-process training, keeping the whole
  gradient; ``step`` reduce-scatters each bucket (rank r receives the sum of its slice only),
  updates its slice, and all-gathers the updated parameters. Bytes: Ψ + Ψ, the same 2Ψ as DP.
* **2** -- gradients sharded too. The reduce-scatter of a bucket starts from the backward hook as
  soon as the bucket is complete (as DDP's all-reduce does) and the full gradient is dropped: a rank
  keeps only its slice. Same bytes as stage 1.
* **3** -- parameters sharded too. Each *unit* (default: the model's top-level layers) keeps only
  its slice; ``_gather_unit`` all-gathers the full parameters just before the unit's forward and
  ``_release_unit`` frees them right after. Ops save parameters for backward (``linear`` keeps its
  weight): a ``saved_tensors_hooks`` pack turns them into references, and the unpack in backward
  all-gathers the unit again; it is freed when all its gradients are done. Bytes: Ψ (forward
  gathers) + Ψ (backward gathers) + Ψ (reduce-scatter) = 3Ψ, 1.5x DP -- less a unit whose backward
  needs no weights and so is not gathered again (a GPT's Embed: a lookup's gradient needs the ids).

Per-rank memory (``memory_arrays``, read by ``minidist.memory.MemoryAccountant.report``) follows
``minidist.memory.zero_formula``. Loss weighting, ``backward(loss, n_samples)`` and ``no_sync`` are
DDP's (with ``no_sync`` full gradients are accumulated locally and reduced on the last micro-step).
"""

from __future__ import annotations

import numpy as np

from minidist.comm import all_gather, all_reduce
from minidist.comm.collectives import split_sizes
from minidist.nn.module import Parameter
from minidist.parallel.compose import check_compatible
from minidist.parallel.ddp import Bucket, DistributedDataParallel, build_buckets
from minidist.tensor import current_saved_tensors_hooks, saved_tensors_hooks


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

    ``units`` (stage 3): modules gathered and freed as one; every trainable parameter must belong to
    exactly one unit. Frozen parameters stay replicated. ``full_parameters()`` gives the whole model.
    """

    def __init__(self, module, comm, optimizer, stage: int = 2, bucket_bytes: float = 4 << 20,
                 units=None, broadcast_from: int | None = 0):
        if stage not in (1, 2, 3):
            raise ValueError(f"rank {comm.rank}: ZeRO stage must be 1, 2 or 3, got {stage!r}")
        self.stage = stage
        self.technique = f"zero{stage}"
        check_compatible(module, self.technique)  # before units are looked for: a stage has none
        self._unit_pending: dict[int, int] = {}
        self.gather_log: list[tuple] = []  # (unit, "forward"|"backward"|"state"), for the ledger check
        self.units = list(units) if units is not None else _units_of(module)
        super().__init__(module, comm, bucket_bytes=bucket_bytes, algorithm="ring",
                         broadcast_from=broadcast_from)
        self.shards = []
        for b in self.buckets:
            lo, hi = b.shard(comm.rank, comm.size)
            flat = b.flatten([p.data for p in b.params])
            self.shards.append(Parameter(flat[lo:hi].copy()))
        self.optimizer = optimizer(self.shards)
        self._flats: dict[int, object] = {}
        self.gathered: set[int] = set()
        self._handles_zero3 = []
        if stage == 3:
            for u in range(len(self.units)):
                self._wrap_unit(u)
                self._release_unit(u)

    # -- buckets: stage 3 uses one bucket (per dtype) per unit, in backward order ---------------
    def _make_buckets(self, bucket_bytes) -> list[Bucket]:
        if self.stage < 3:
            return super()._make_buckets(bucket_bytes)
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

    # -- gradients: reduce-scatter instead of all-reduce -----------------------------------------
    def _on_grad_ready(self, p):
        if self.stage == 1:
            self._hooked = True
            return  # stage 1 communicates only in step()
        super()._on_grad_ready(p)
        if self.stage == 3:
            u = self._unit_of[self._bucket_of[id(p)].index]
            self._unit_pending[u] -= 1
            if self._unit_pending[u] == 0:
                self._release_unit(u)

    def _launch(self, b: Bucket, flat):
        """Start bucket ``b``'s reduce-scatter (``DistributedDataParallel._start`` flattened it).

        Stage 1 on an in-place backend keeps the flat bucket as the gradient storage: the ``p.grad``
        become views of it, and ``_complete`` writes this rank's reduced slice back into it."""
        from minidist.comm import reduce_scatter

        if self.stage == 1 and b.params[0].backend.inplace:
            self._flats[b.index] = flat
            for p, v in zip(b.params, b.views(flat)):
                p.grad = v
        return self._async(reduce_scatter, flat, f"reduce-scatter b{b.index}", op="sum")

    def _complete(self, b: Bucket, mine, divisor: float):
        g = mine / divisor if divisor != 1 else mine
        flat = self._flats.pop(b.index, None)
        if flat is not None:  # stage 1: write our reduced slice back into the full gradient buffer
            lo, hi = b.shard(self.comm.rank, self.comm.size)
            flat[lo:hi] = g
            g = flat[lo:hi]
        self.shards[b.index].grad = g

    # -- the step --------------------------------------------------------------------------------
    def step(self):
        """Finish the gradient sync, update the owned slices, share the new parameters, zero grads."""
        self.wait_gradients()
        self.update()

    def update(self):
        """The second half of ``step`` (after ``wait_gradients``): optimizer step on the owned slices,
        all-gather of the new parameters (stages 1, 2), zero grads."""
        self.optimizer.step()
        if self.stage < 3:
            for b in self.buckets:
                self._gather_bucket(b)
        else:
            for u in sorted(self.gathered):
                self._release_unit(u)
        self.zero_grad()

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
        self._flats.clear()

    # -- stage 3: gather before use, free after --------------------------------------------------
    def _gather_unit(self, u: int, phase: str = "backward"):
        if u in self.gathered:
            return
        self.gather_log.append((u, phase))
        for b in self._unit_buckets[u]:
            self._gather_bucket(b)
        self.gathered.add(u)

    def _release_unit(self, u: int):
        for b in self._unit_buckets[u]:
            xp = b.params[0].backend.xp
            empty = xp.zeros((), b.dtype)
            for p in b.params:
                p.data = xp.broadcast_to(empty, p.shape)  # right shape, one element of memory
        self.gathered.discard(u)

    def _wrap_unit(self, u: int):
        """Register unit ``u``'s gather/release at the ``"zero3"`` position of its wrapper stack."""
        self._handles_zero3.append(self.units[u].register_forward_wrapper(
            lambda unit, inner, *a, **kw: self._gathered_forward(u, inner, a, kw), "zero3", "ZeRO-3"))

    def _gathered_forward(self, u: int, inner, args, kwargs):
        """Gather unit ``u``, run ``inner`` with parameters saved as references, release."""
        self._gather_unit(u, "forward")
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
            self._release_unit(u)

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
        if self.stage < 3:
            for b in self.buckets:
                self._gather_bucket(b)
        return self

    # -- reading the model -----------------------------------------------------------------------
    def full_parameters(self) -> dict:
        """Name -> full parameter array (collective: stage 3 all-gathers every unit's slices)."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        out = {n: p.data for n, p in self.module.named_parameters() if not p.requires_grad or self.stage < 3}
        if self.stage == 3:
            for b in self.buckets:
                out.update({names[id(p)]: v for p, v in zip(b.params, self._full_views(b))})
        return {n: out[n] for n in names.values()}

    def memory_arrays(self) -> dict:
        """What this rank holds between steps, for ``MemoryAccountant.report``."""
        params = self.module.parameters()
        opt = [v for st in self.optimizer.state for v in st.values() if hasattr(v, "nbytes")]
        if self.stage == 3:
            held = [s.data for s in self.shards] + [p.data for p in params if not p.requires_grad]
            held += [p.data for u in self.gathered for b in self._unit_buckets[u] for p in b.params]
        else:
            held = [p.data for p in params]
        grads = [s.grad for s in self.shards] + [p.grad for p in params]
        return {"params": held, "grads": grads, "optimizer_state": opt}


def param_count(module) -> int:
    """Ψ: the number of trainable parameters."""
    return int(sum(p.size for p in module.parameters() if p.requires_grad))


__all__ = ["ZeRO", "all_gather_flat", "param_count"]
