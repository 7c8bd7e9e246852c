"""Cross-entropy of integer targets under logits, as one op that keeps only what its backward needs."""

from __future__ import annotations

from minidist.accel.backend import backend_of
from minidist.autograd.ops.arrays import _xp
from minidist.autograd.tensor import Function


def ce_rows(logits, targets, ignore_index):
    """(logits as rows (N, V), each row's target or 0 where ignored, which rows count)."""
    xp = _xp(logits)
    t = xp.asarray(targets).reshape(-1)  # host targets onto the logits' device (CuPy won't mix)
    valid = t != ignore_index
    return logits.reshape(-1, logits.shape[-1]), xp.where(valid, t, 0), valid


class CrossEntropy(Function):
    """Mean negative log-likelihood of integer ``targets`` under ``logits`` (last axis = classes).

    With e = exp(x - max x) and s = Σ e per row, the loss is log s - (x_t - max x), and the gradient
    (softmax - one_hot)·g/n = e·(g/n)/s, minus g/n at each target. Forward keeps e and s, so backward
    is one pass over the logits and one write per row. Targets equal to ``ignore_index`` contribute
    nothing and are not counted in n.
    """

    @staticmethod
    def forward(ctx, logits, targets, ignore_index=-1):
        x, t, valid = ce_rows(logits, targets, ignore_index)
        shifted = x - x.max(axis=-1, keepdims=True)
        logit_t = _xp(x).take_along_axis(shifted, t[:, None], axis=-1)[:, 0]  # x_t - max x
        e = _xp(x).exp(shifted)
        return CrossEntropy.finish(ctx, logits, logit_t, e, e.sum(axis=-1, keepdims=True), t, valid)

    @staticmethod
    def finish(ctx, logits, logit_t, e, s, t, valid):
        """The mean of log s - (x_t - max x) over the rows that count; keeps e and s for backward."""
        xp = _xp(e)
        total = ((xp.log(s[:, 0]) - logit_t) * valid).sum()
        # the count stays an array (no host read-back, so the op compiles on JAX), in the loss's
        # dtype: what dividing by a Python int does on NumPy, so the result is the same bits
        n = xp.maximum(valid.sum(), 1).astype(total.dtype)
        ctx.save(e, s)
        ctx.t, ctx.valid, ctx.n, ctx.shape = t, valid, n, logits.shape
        return (total / n).astype(logits.dtype)

    @staticmethod
    def backward(ctx, g):
        e, s = ctx.saved
        be = backend_of(e)
        scale = (g / ctx.n) * ctx.valid.astype(e.dtype)  # per row: g/n, or 0 where ignored
        grad = e * (scale[:, None] / s)
        grad = be.scatter_add(grad, (be.xp.arange(grad.shape[0]), ctx.t), -scale)
        return grad.reshape(ctx.shape), None
