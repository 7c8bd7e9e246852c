"""Gradient buckets: parameters of one dtype whose gradients travel in one message, as one flat array.

DDP cuts its parameters (in reverse, the order backward produces their gradients) into buckets of at
most ``bucket_bytes`` (``build_buckets``), flattens a bucket's gradients into one array for its
collective (``Bucket.flatten``) and views the result as the parameters again (``Bucket.views``).
ZeRO gives rank r the slice ``Bucket.shard(r, N)`` of every flat bucket. A bucket is layout only:
what one backward has done with it lives in DDP's ``SyncWindow``. A comm hook (``compress/``) sees
one bucket's gradient as a ``GradBucket``.
"""

from __future__ import annotations

import numpy as np

from minidist.accel import compiled
from minidist.accel.backend import backend_of, host_scalar
from minidist.comm import split_sizes, start_async


@compiled.pure  # on JAX one compiled call, not a zeros/reshape program per parameter and a concat
def _flatten(xp, arrays, sizes, dtype):
    return xp.concatenate([xp.zeros(n, dtype) if a is None else a.reshape(-1) for a, n in zip(arrays, sizes)])


@compiled.pure  # on JAX one compiled call, not a slice and a reshape program per parameter
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

    def flatten(self, arrays):
        """One flat array of the bucket's parameters' arrays (None -> zeros), in bucket order."""
        return _flatten(self.params[0].backend.xp, list(arrays), tuple(self.sizes), self.dtype)

    def views(self, flat, divisor: float = 1.0) -> list:
        """The inverse of ``flatten``: per-parameter views of ``flat`` (divided by ``divisor``, a new
        array then). The divisor is a host scalar of ``flat``'s dtype: on JAX an argument of the
        compiled call, so a new divisor compiles no new program."""
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


class GradBucket:
    """One bucket's gradient as a comm hook sees it (PyTorch's ``GradBucket``): ``buffer()`` the flat
    gradient (don't modify it before the handle completes), ``shapes`` its parameters', ``index``,
    ``is_last`` (a hook counts steps there); ``start(fn, x, label)`` runs ``fn(comm, x)`` on the async
    worker (``comm``: its private channel) and returns the Handle. Hooks are NumPy code: on another
    backend (CuPy, JAX) ``x`` arrives as a host copy and the result goes back."""

    def __init__(self, index: int, flat, shapes, comm, start=None, algorithm: str = "ring",
                 is_last: bool = True):
        self.index, self.flat, self.comm, self.algorithm, self.is_last = index, flat, comm, algorithm, is_last
        self.shapes = [tuple(s) for s in shapes]
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        if sum(self.sizes) != flat.size:
            raise ValueError(f"rank {comm.rank}: bucket {index} shapes {self.shapes} hold {sum(self.sizes)} "
                             f"elements, the flat gradient {flat.size}")
        self._start = start or (lambda fn, x, label: start_async(comm, lambda c, y, _: fn(c, y), x, label))

    def buffer(self):
        return self.flat

    def start(self, fn, x, label: str):
        be = backend_of(x)
        if be.name != "numpy":
            return self._start(lambda c, y: be.from_host(fn(c, np.asarray(be.to_host(y)))), x, label)
        return self._start(fn, x, label)

    def views(self, flat) -> list:
        """Per-parameter views of ``flat`` in their shapes."""
        offsets = np.cumsum([0] + self.sizes)
        return [flat[o:o + n].reshape(s) for o, n, s in zip(offsets, self.sizes, self.shapes)]
