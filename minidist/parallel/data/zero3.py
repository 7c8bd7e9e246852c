"""ZeRO-3 (FSDP): the parameters sharded too, each unit gathered just before it is used and freed after.

Gradients and optimizer state are sharded as in stage 2 (``sharded.py``). A forward wrapper on each
unit (default: the model's top-level layers), at the ``"zero3"`` position of ``Module``'s stack,
all-gathers the unit before its forward and frees it after; a ``saved_tensors_hooks`` pack saves
references instead of parameters, and backward gathers the unit again. Bytes: 3Ψ, 1.5x DP (less a
unit whose backward needs no weights: an Embed). A recomputation (``recomputing_depth``) keeps its
unit gathered for the backward right after it.
"""

from __future__ import annotations

from typing import NamedTuple

from minidist.autograd.modes import current_saved_tensors_hooks, recomputing_depth, saved_tensors_hooks
from minidist.parallel.data.buckets import Bucket, build_buckets
from minidist.parallel.data.sharded import ShardedDataParallel, all_gather_flat


class _ParamRef(NamedTuple):
    """What the stage-3 pack hook saves instead of a gathered parameter array."""
    param: object
    unit: int


class ZeRO3(ShardedDataParallel):
    """Stage 3. Buckets: one per unit (and dtype), in backward order. ``prefetch=True``: unit u's
    forward starts unit u+1's all-gather on the async worker (FSDP's forward prefetch)."""

    stage = 3

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
        """Start all-gathering unit ``u`` on the async worker (collective): its bytes travel while the
        current unit computes, and ``gather_unit`` only waits. One more unit in memory, same bytes."""
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
        return lambda unit, inner, *args, **kwargs: self._gathered_forward(u, inner, args, kwargs)

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
