"""The recorded graph, and the walk that differentiates it.

A ``Node`` remembers one operation; anything else in the graph is a leaf ``Tensor``. ``run_backward``
walks the graph iteratively (no recursion limit): it counts how many consumers must send each node
or leaf a gradient (``count_consumers``) and processes one only when all have, so every gradient is
complete before it is propagated. A leaf's gradient is accumulated into ``leaf.grad`` (replaced,
never mutated) and its post-accumulate hooks fire at once: data parallelism launches its
all-reduces from them while the rest of the backward pass is still running.
"""

from __future__ import annotations

import numpy as np

from minidist.accel import compiled
from minidist.autograd import meter


class Node:
    """One recorded operation: the Function, its context, and where each input's gradient goes.

    ``parents[i]`` is the Node that produced input i, the input itself if it is a leaf that wants a
    gradient, or None; ``shapes[i]`` its shape (None for a non-Tensor input), which backward checks.
    The graph holds Nodes, not the tensors between them, so an activation's memory is freed as soon
    as nothing else refers to it -- unless an op saved it for backward (``Context.save``).
    """

    __slots__ = ("fn", "ctx", "parents", "shapes", "hooks")

    def __init__(self, fn, ctx, parents, shapes):
        self.fn, self.ctx, self.hooks = fn, ctx, None
        self.parents, self.shapes = parents, shapes


def _accumulate(a, b):
    if a is None:
        return b
    return a + b if type(a) is np.ndarray else _add(a, b)


@compiled.pure
def _add(a, b):
    """A gradient sum off NumPy: on JAX one stored program per shape, not an eager ``+``."""
    return a + b


def finish_leaf(leaf, g) -> None:
    """A leaf whose gradient ``g`` is complete: its hooks (each may replace g), accumulate into
    ``.grad``, then its post-accumulate hooks (DDP's bucket readiness)."""
    for hook in leaf._hooks or ():
        out = hook(g)
        g = g if out is None else out
    leaf.grad = _accumulate(leaf.grad, g)
    for hook in leaf._post_hooks or ():
        hook(leaf)


def count_consumers(start) -> dict[int, int]:
    """id(node or leaf) -> how many graph edges point at it, below ``start`` (an iterative
    depth-first walk): a node runs its backward once all of them have delivered."""
    pending: dict[int, int] = {}
    stack = [start]
    while stack:
        item = stack.pop()
        if not isinstance(item, Node):  # a leaf
            continue
        if item.ctx is None:
            raise RuntimeError("backward through a graph a second time: its saved arrays were freed; "
                               "pass retain_graph=True to the first backward()")
        for parent in item.parents:
            if parent is not None:
                pending[id(parent)] = pending.get(id(parent), 0) + 1
                if pending[id(parent)] == 1:
                    stack.append(parent)
    return pending


def run_backward(root, grad, retain_graph: bool = False) -> None:
    """Reverse-mode differentiation from ``root`` with seed gradient ``grad``.

    1. Count, by an iterative depth-first walk, how many graph edges point at each node or leaf.
    2. Process those whose consumers have all delivered their gradient (a stack: depth first, so
       a layer's parameters become ready as soon as that layer's backward has run).
    """
    start = root if root._node is None else root._node
    pending = count_consumers(start)
    grads = {id(start): grad}
    ready = [start]
    while ready:
        item = ready.pop()
        g = grads.pop(id(item), None)
        if not isinstance(item, Node):  # a leaf: run its hooks, accumulate, tell whoever waits for it
            if g is not None:
                finish_leaf(item, g)
            continue
        if g is None:  # every consumer returned None: nothing flows, but the parents must hear so
            in_grads = (None,) * len(item.parents)
        else:
            for hook in item.hooks or ():
                out = hook(g)
                g = g if out is None else out
            in_grads = item.fn.backward(item.ctx, g)
            if not isinstance(in_grads, tuple):
                in_grads = (in_grads,)
            if meter.METER is not None:
                meter.METER(item.fn, (g,), in_grads, True)
        for parent, shape, ig in zip(item.parents, item.shapes, in_grads):
            if parent is None:
                continue
            if ig is not None:
                if tuple(ig.shape) != shape:
                    raise RuntimeError(f"{item.fn.__name__}.backward returned a gradient of shape "
                                       f"{tuple(ig.shape)} for an input of shape {shape}")
                grads[id(parent)] = _accumulate(grads.get(id(parent)), ig)
            pending[id(parent)] -= 1
            if pending[id(parent)] == 0:
                ready.append(parent)
        if g is not None and not retain_graph:
            item.ctx.release()
            item.ctx = None
