"""Exercise 6: activation recomputation -- keep a function's input, recompute its insides in backward.

Estimated time: 1 h (recompute 45 min, the segment size 15 min)
Points: recompute 4, best_segment_size 2.
Grade it:  python -m minidist.grade checkpointing
The grader runs a small MLP block with dropout plainly and through your ``recompute``: the output,
every gradient and the random state afterwards must be bit-for-bit the same, and your forward may
keep only the block's input for backward. Lesson: lessons/06-checkpointing.md; minidist's answer
is minidist/parallel/memory/recompute.py, so try before you look.

What you need from minidist (see minidist/autograd/tensor.py): a ``Function`` subclass has static methods
``forward(ctx, *arrays, **kw) -> array`` and ``backward(ctx, grad) -> one gradient per input``, is
called as ``MyFunction.apply(*tensors, **kw)``; ``ctx.save(*arrays)`` keeps arrays for backward
(read them back as ``ctx.saved``), ``ctx.needs_grad[i]`` says if input i wants a gradient;
``no_grad()`` / ``enable_grad()`` switch graph recording; ``run_backward(out, grad)`` back-propagates
``grad`` from ``out`` through its graph (parameters used inside get their ``.grad``).
Dropout draws from ``minidist.autograd.random``: ``get_state()`` / ``set_state(state)``.
"""

import numpy as np  # noqa: F401  (you will need it)

from minidist.autograd import random as mrandom  # noqa: F401  (you will need it)
from minidist.autograd.tensor import Function, Tensor, enable_grad, no_grad, run_backward  # noqa: F401


def recompute(fn, x):
    """``fn(x)`` for a Tensor ``x`` (requires_grad=True) and a function of one Tensor returning one
    Tensor, such that only ``x`` (and the random state) is kept for backward.

    Forward: note the random state, run fn under ``no_grad()`` (nothing inside is recorded or
    saved), save x. Backward: set the noted random state again -- so dropout draws the same masks --
    re-run fn on a fresh leaf Tensor(x, requires_grad=True) with gradients on, back-propagate the
    incoming gradient through it, return the leaf's gradient; then put the random state back to
    what it was before the recomputation (backward must not consume random numbers).
    Does not modify x.
    """
    raise NotImplementedError


def best_segment_size(n_layers, segment_input, block_saved):
    """The k in 1..n_layers that keeps the fewest activation elements when recomputing segments of
    k blocks: ceil(n_layers / k) segment inputs of ``segment_input`` elements each are kept through
    the whole step, plus one segment's ``k * block_saved`` while it is recomputed in backward.

    With L = n_layers, BTC = segment_input, A = block_saved the cost (L/k)·BTC + k·A is least near
    k* = sqrt(L·BTC/A), not sqrt(L) -- below 1 when a block saves more than L segment inputs.
    Ties: the smallest k.
    """
    raise NotImplementedError
