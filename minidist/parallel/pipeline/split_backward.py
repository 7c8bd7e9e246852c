"""Backward split in two, as zero-bubble pipelines need: B (input gradients) now, W (weight gradients) later.

A stage's backward does two jobs. The gradient for the stage's *input* is on the critical path:
the previous stage waits for it. The gradients for the stage's *weights* are not: nobody needs them
until the optimizer step. `backward_input(out, grad, inputs)` (B) walks the same graph as
`Tensor.backward` in the same order, but every edge into a parameter -- a leaf that requires a
gradient and is not one of `inputs` -- is deferred: the op is called with only its other inputs
marked as needing a gradient (Linear computes gX = G·Wᵀ and skips gW = Xᵀ·G), and the op's node
(its saved arrays) and output gradient go on a `WeightGradQueue`. An op whose only differentiable
inputs are parameters (an embedding lookup) is deferred whole. `queue.run()` (W) calls each deferred
op again with only the parameter inputs marked and accumulates into `p.grad` exactly as
`Tensor.backward` would (same order, same hooks: data parallelism's all-reduces start from W).

Every gradient is computed by the same op code on the same arrays as in one backward, so B then W
gives bit for bit the same `x.grad` and `p.grad`. The price is memory: what W needs (each deferred
op's saved arrays -- a Linear's input X -- and its output gradient G) lives from B until W;
`WeightGradQueue.nbytes()` counts it (distinct buffers, parameters left out).
"""

from __future__ import annotations

import numpy as np

from minidist.autograd import meter
from minidist.autograd.graph import finish_leaf
from minidist.autograd.tensor import Tensor, _accumulate, count_consumers
from minidist.nn.footprint import storage_bytes


def _as_tuple(grads) -> tuple:
    return grads if isinstance(grads, tuple) else (grads,)


def _call(node, g, mask) -> tuple:
    """``node.fn.backward`` with only the inputs in ``mask`` marked as wanting a gradient."""
    ctx = node.ctx
    full = ctx.needs_grad
    ctx.needs_grad = tuple(bool(n and k) for n, k in zip(full, mask))
    try:
        grads = _as_tuple(node.fn.backward(ctx, g))
        if meter.METER is not None:  # the virtual clock's device model prices B's and W's parts apart
            meter.METER(node.fn, (g,), grads, True)
        return grads
    finally:
        ctx.needs_grad = full


def _check_shape(node, shape, ig) -> None:
    if tuple(ig.shape) != shape:
        raise RuntimeError(f"{node.fn.__name__}.backward returned a gradient of shape "
                           f"{tuple(ig.shape)} for an input of shape {shape}")


class WeightGradQueue:
    """What B left for W on one microbatch: (node, output gradient, which inputs were deferred)."""

    def __init__(self):
        self.entries: list[tuple] = []
        self.pending: dict[int, int] = {}   # id(parameter) -> deferred edges into it not yet run
        self.params: dict[int, Tensor] = {}
        self.done = False

    def __len__(self) -> int:
        return len(self.entries)

    def _defer(self, node, g, mask) -> None:
        self.entries.append((node, g, mask))
        for parent, deferred in zip(node.parents, mask):
            if deferred:
                self.pending[id(parent)] = self.pending.get(id(parent), 0) + 1
                self.params[id(parent)] = parent

    def nbytes(self) -> int:
        """Bytes W keeps alive: the deferred ops' saved arrays and output gradients, parameters excluded."""
        exclude = {id(p.data) for p in self.params.values()}
        arrays = []
        for node, g, _ in self.entries:
            saved = node.ctx._saved if node.ctx is not None else ()
            for a in saved:
                a = getattr(a, "array", a)  # a saved-tensors hook's wrapper (the memory accountant's)
                if hasattr(a, "nbytes") and id(a) not in exclude:
                    arrays.append(a)
            arrays.append(g)
        return storage_bytes(arrays)

    def run(self) -> None:
        """W: compute and accumulate every deferred parameter gradient, then free what B kept."""
        if self.done:
            raise RuntimeError("WeightGradQueue.run() twice: this microbatch's weight gradients are done")
        grads: dict[int, object] = {}
        for node, g, mask in self.entries:
            in_grads = _call(node, g, mask) if g is not None else (None,) * len(mask)
            for parent, shape, ig, deferred in zip(node.parents, node.shapes, in_grads, mask):
                if not deferred:
                    continue
                key = id(parent)
                if ig is not None:
                    _check_shape(node, shape, ig)
                    grads[key] = _accumulate(grads.get(key), ig)
                self.pending[key] -= 1
                if self.pending[key] == 0 and key in grads:
                    finish_leaf(parent, grads.pop(key))
            node.ctx.release()
            node.ctx = None
        self.entries, self.done = [], True


def _seed(root: Tensor, grad):
    if grad is None:
        if root.size != 1:
            raise RuntimeError(f"backward_input() on a non-scalar tensor of shape {root.shape} needs an "
                               "explicit gradient of that shape")
        return np.ones(root.data.shape, dtype=root.dtype) if type(root.data) is np.ndarray else \
            root.backend.asarray(np.ones(root.data.shape, dtype=root.dtype))
    grad = grad.data if isinstance(grad, Tensor) else grad
    if not root.backend.is_array(grad):
        grad = root.backend.asarray(grad)
    if tuple(grad.shape) != root.shape or grad.dtype != root.dtype:
        raise ValueError(f"backward_input(): gradient {tuple(grad.shape)} {grad.dtype} does not match the "
                         f"tensor's shape {root.shape} and dtype {root.dtype}")
    return grad


def backward_input(root: Tensor, grad=None, inputs=()) -> WeightGradQueue:
    """B: accumulate d(root)/d(x) into ``x.grad`` for each x in ``inputs``; defer every parameter's
    gradient to the returned queue (run it for W). ``grad``: the seed, as for ``Tensor.backward``."""
    if not isinstance(root, Tensor) or root._node is None:
        raise RuntimeError("backward_input() needs a tensor computed from inputs that require grad")
    grad = _seed(root, grad)
    keep = {id(t) for t in inputs}
    start = root._node
    pending = count_consumers(start)

    queue = WeightGradQueue()
    grads = {id(start): grad}
    ready = [start]
    while ready:
        item = ready.pop()
        g = grads.pop(id(item), None)
        if isinstance(item, Tensor):  # only inputs get here: parameters' counts never reach 0 in B
            if g is not None:
                finish_leaf(item, g)
            continue
        if g is not None:
            for hook in item.hooks or ():
                out = hook(g)
                g = g if out is None else out
        mask = tuple(isinstance(p, Tensor) and id(p) not in keep for p in item.parents)
        now = tuple(p is not None and not d for p, d in zip(item.parents, mask))
        if g is not None and any(now):
            in_grads = _call(item, g, now)
        else:
            in_grads = (None,) * len(item.parents)
        for parent, shape, ig, deferred in zip(item.parents, item.shapes, in_grads, mask):
            if parent is None or deferred:
                continue
            if ig is not None:
                _check_shape(item, shape, ig)
                grads[id(parent)] = _accumulate(grads.get(id(parent)), ig)
            pending[id(parent)] -= 1
            if pending[id(parent)] == 0:
                ready.append(parent)
        if any(mask):
            queue._defer(item, g, mask)
        else:
            item.ctx.release()
            item.ctx = None
    return queue
