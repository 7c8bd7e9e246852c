"""What every ZeRO stage shares: the shard layout, the optimizer over it, the step, the sharded checkpoint.

Rank r *owns* the slice ``Bucket.shard(r, N)`` of every flat gradient bucket. ``ShardedDataParallel``
is DDP (backward, ``no_sync``, the sync window) whose optimizer sees only those slices (``shards``:
its state is 1/N of DP's): ``reduce`` reduce-scatters a bucket, ``finish`` keeps my slice of the
sum, ``step`` = ``wait_gradients`` + ``update`` (my slices step, then ``share_parameters``
all-gathers them). ``state_dict`` / ``load_state_dict``: each rank saves and restores what it owns.
"""

from __future__ import annotations

import numpy as np

from minidist.comm import all_gather, all_reduce, reduce_scatter, split_sizes
from minidist.nn.module import Parameter
from minidist.parallel.data.buckets import Bucket
from minidist.parallel.data.ddp import DistributedDataParallel


def all_gather_flat(comm, shard, numel: int):
    """The flat array of ``numel`` elements whose ``np.array_split`` part r is rank r's ``shard``:
    ``minidist.comm.all_gather`` with the part sizes every rank knows (no shape headers)."""
    return all_gather(comm, shard, axis=0, sizes=split_sizes(numel, comm.size))


def param_count(module) -> int:
    """Ψ: the number of trainable parameters."""
    return int(sum(p.size for p in module.parameters() if p.requires_grad))


def units_of(module) -> list:
    """The default units of ZeRO-3: a model's top-level layers (the model itself if it has none)."""
    children = module.children()
    return children if children and not module._params else [module]


class ShardedDataParallel(DistributedDataParallel):
    """The base of ``ZeRO1``, ``ZeRO2``, ``ZeRO3``. ``units``: modules ZeRO-3 gathers and frees as one
    (the others keep them to report). Frozen parameters stay replicated."""

    stage = 0  # set by each stage's class

    def __init__(self, module, comm, optimizer, bucket_bytes: float = 4 << 20, units=None,
                 broadcast_from: int | None = 0):
        self.units = list(units) if units is not None else units_of(module)
        self.gather_log: list[tuple] = []  # (unit, "forward"|"backward"): stage 3's gathers
        super().__init__(module, comm, bucket_bytes=bucket_bytes, algorithm="ring",
                         broadcast_from=broadcast_from)
        self.shards = []
        for b in self.buckets:
            lo, hi = b.shard(comm.rank, comm.size)
            shard = b.flatten([p.data for p in b.params])[lo:hi]
            self.shards.append(Parameter(shard.copy() if b.params[0].backend.inplace else shard))  # a view
        self.optimizer = optimizer(self.shards)

    # -- every stage: my slice of the sum, my slice steps, the model whole again ------------------
    def reduce(self, b: Bucket, flat):
        """Start bucket ``b``'s reduce-scatter: this rank receives the sum over ranks of its slice."""
        return self.start_collective(reduce_scatter, flat, f"reduce-scatter b{b.index}", op="sum")

    def finish(self, b: Bucket, mine, divisor: float) -> None:
        """This rank's slice of bucket ``b``'s summed gradient, averaged: its shard's gradient."""
        self.shards[b.index].grad = mine / divisor if divisor != 1 else mine

    def step(self):
        """Finish the gradient sync, update the owned slices, share the new parameters, zero grads."""
        self.wait_gradients()
        self.update()

    def update(self):
        """``step`` after ``wait_gradients``: my slices step, ``share_parameters``, zero grads."""
        self.optimizer.step()
        self.share_parameters()
        self.zero_grad()

    def share_parameters(self) -> None:
        """All-gather every bucket: each rank holds the whole model again (stages 1, 2)."""
        for b in self.buckets:
            self.gather_bucket(b)

    def full_views(self, b: Bucket) -> list:
        """All-gather bucket ``b``'s slices (collective) and view the flat result as its parameters."""
        return b.views(all_gather_flat(self.comm, self.shards[b.index].data, b.numel))

    def gather_bucket(self, b: Bucket) -> None:
        """Every parameter of bucket ``b`` whole again on this rank (collective)."""
        for p, v in zip(b.params, self.full_views(b)):
            p.data = v

    _gather_bucket = gather_bucket  # the name minidist.resilience.checkpoint.state calls

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip the *global* gradient norm (after ``wait_gradients``, before ``update``): the squared
        norms of the ranks' slices, summed over ranks."""
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
    def _layout(self) -> dict:
        return {"stage": self.stage, "rank": self.comm.rank, "size": self.comm.size,
                "numels": [b.numel for b in self.buckets]}

    def state_dict(self) -> dict:
        """This rank's slices of the parameters (at stage 3 the only copy), its optimizer state, and
        the layout to check them against on load."""
        return dict(self._layout(), shards=[np.array(s.backend.to_host(s.data)) for s in self.shards],
                    optimizer=self.optimizer.state_dict())

    def load_state_dict(self, sd: dict):
        """Restore what ``state_dict`` saved on this rank, then ``share_parameters`` (collective)."""
        want = self._layout()
        got = {k: sd.get(k) for k in want}
        if got != want:
            raise ValueError(f"rank {self.comm.rank}: this ZeRO checkpoint shard was saved with {got}, "
                             f"but this run has {want}; load each rank's own shard, with the same "
                             "model, stage and world size")
        for shard, arr in zip(self.shards, sd["shards"]):
            shard.data = shard.backend.from_host(np.array(arr, dtype=shard.dtype))
        self.optimizer.load_state_dict(sd["optimizer"])
        self.share_parameters()
        return self

    def full_parameters(self) -> dict:
        """Name -> full parameter array (every rank holds them at stages 1 and 2)."""
        return {n: p.data for n, p in self.module.named_parameters()}

    def memory_arrays(self) -> dict:
        """What this rank holds between steps, for ``MemoryAccountant.report``."""
        params = self.module.parameters()
        opt = [v for st in self.optimizer.state for v in st.values() if hasattr(v, "nbytes")]
        grads = [s.grad for s in self.shards] + [p.grad for p in params]
        return {"params": self.held_parameters(), "grads": grads, "optimizer_state": opt}

    def held_parameters(self) -> list:
        """The parameter arrays this rank holds now."""
        return [p.data for p in self.module.parameters()]
