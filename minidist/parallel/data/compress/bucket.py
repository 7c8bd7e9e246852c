"""What a communication hook receives: ``GradBucket`` (DDP builds one per bucket; hooks are ``compress/``)."""

from __future__ import annotations

import numpy as np

from minidist.accel.backend import backend_of
from minidist.comm import start_async


class GradBucket:
    """One bucket of gradients, as a hook sees it (PyTorch's ``GradBucket``).

    ``buffer()``: the flat gradient (this rank's; don't modify it before the handle completes).
    ``shapes``: the parameters' shapes, in order (PowerSGD reshapes its matrices from them).
    ``index``: which bucket (hooks keep per-bucket state: residuals, warm-start Q).
    ``is_last``: the last bucket of this step (a hook counts steps there).
    ``start(fn, x, label)``: run ``fn(comm, x)`` on the async worker and return its Handle --
    ``comm`` is the worker's private channel of the data-parallel communicator. Hooks are NumPy code:
    on another backend (CuPy, JAX) ``x`` arrives as a host copy and the result goes back.
    """

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
        out, o = [], 0
        for s, n in zip(self.shapes, self.sizes):
            out.append(flat[o:o + n].reshape(s))
            o += n
        return out
