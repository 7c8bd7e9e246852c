"""The MoE block's steps as differentiable ops, each ONE op forward and one backward.

``Dispatch`` copies the kept tokens into the (E·C, d) expert buffer, ``ExpertMLPs`` runs every
local expert's MLP on its rows, ``Combine`` takes the top-k gates from the router's probabilities
and adds each kept assignment's output row, times its gate, to its token; ``LoadBalancingLoss`` and
``RouterZLoss`` are the Switch Transformer's auxiliary losses. A kept assignment is a token ``tok``,
its choice ``choice`` and its buffer row ``rows``. Each op replaces a chain of ``x[idx]``, ``*``,
``reshape``, ``concat`` (~55 ops a block; on JAX a compiled call each), and its backward is that
chain's rule in the same order: NumPy's results are the chain's bit for bit (``tests/nn/test_moe.py``).
"""

from __future__ import annotations

import numpy as np

from minidist.accel.backend import backend_of
from minidist.autograd.ops.arrays import unbroadcast
from minidist.autograd.ops.elementwise import Gelu
from minidist.autograd.ops.matmul import Linear
from minidist.autograd.tensor import Function


class Dispatch(Function):
    """buf (rows_total, d) = zeros; ``buf[rows[i]] += x[tok[i]] · keep[i]`` (``keep`` None: 1).
    Backward: ``gx[tok[i]] += g[rows[i]] · keep[i]``."""

    compilable = True

    @staticmethod
    def forward(ctx, x, tok, rows, keep, rows_total):
        be = backend_of(x)
        ctx.tok, ctx.rows, ctx.keep, ctx.n = tok, rows, keep, x.shape[0]
        picked = x[tok]
        if keep is not None:
            picked = picked * keep
        return be.scatter_add(be.xp.zeros((rows_total, *x.shape[1:]), dtype=x.dtype), rows, picked)

    @staticmethod
    def backward(ctx, g):
        be = backend_of(g)
        picked = g[ctx.rows]
        if ctx.keep is not None:
            picked = picked * ctx.keep
        gx = be.scatter_add(be.xp.zeros((ctx.n, *g.shape[1:]), dtype=g.dtype), ctx.tok, picked)
        return gx, None, None, None, None


def _gates(probs, experts):
    """Each token's k gates (N, k): its chosen experts' probabilities, divided by their sum when
    k > 1 (GShard's top-2). Returns (gates, raw, their sum or None)."""
    raw = probs[np.arange(probs.shape[0])[:, None], experts]
    if experts.shape[1] == 1:
        return raw, raw, None
    s = raw.sum(axis=(1,), keepdims=True)
    return raw / s, raw, s


class Combine(Function):
    """out (N, d) = zeros; ``out[tok[i]] += y[rows[i]] · gate_i`` with ``gate_i = gates[tok[i],
    choice[i]] · keep[i]`` and ``gates = _gates(probs, experts)``. Differentiable in the experts'
    output ``y`` and in ``probs`` (through the gates: how the router learns)."""

    compilable = True

    @staticmethod
    def forward(ctx, y, probs, experts, tok, choice, rows, keep):
        be = backend_of(y)
        gates, raw, s = _gates(probs, experts)
        gate = gates[tok, choice].reshape(-1, 1)
        if keep is not None:
            gate = gate * keep
        picked = y[rows]
        ctx.save(picked if ctx.needs_grad[1] else None, gate if ctx.needs_grad[0] else None,
                 raw if ctx.needs_grad[1] else None, s if ctx.needs_grad[1] else None)
        ctx.experts, ctx.tok, ctx.choice, ctx.rows, ctx.keep = experts, tok, choice, rows, keep
        ctx.y_shape, ctx.probs_shape = y.shape, probs.shape
        return be.scatter_add(be.xp.zeros((probs.shape[0], *y.shape[1:]), dtype=y.dtype), tok, picked * gate)

    @staticmethod
    def backward(ctx, g):
        be, (picked, gate, raw, s) = backend_of(g), ctx.saved
        xp, dtype = be.xp, g.dtype
        g_picked = g[ctx.tok]
        gy = gp = None
        if ctx.needs_grad[0]:
            gy = be.scatter_add(xp.zeros(ctx.y_shape, dtype=dtype), ctx.rows, g_picked * gate)
        if ctx.needs_grad[1]:
            g_gate = unbroadcast(g_picked * picked, (picked.shape[0], 1))
            if ctx.keep is not None:
                g_gate = g_gate * ctx.keep
            g_gates = be.scatter_add(xp.zeros(raw.shape, dtype=dtype), (ctx.tok, ctx.choice),
                                     g_gate.reshape(-1))
            if s is not None:  # through gates = raw / s, s = Σ raw (the quotient rule, summed back)
                g_s = unbroadcast(-g_gates * raw / (s * s), s.shape)
                g_gates = g_gates / s + xp.broadcast_to(g_s, raw.shape)
            gp = be.scatter_add(xp.zeros(ctx.probs_shape, dtype=dtype),
                                (np.arange(ctx.probs_shape[0])[:, None], ctx.experts), g_gates)
        return gy, gp, None, None, None, None, None


class _Step:
    """The context one Linear or GELU sees inside ``ExpertMLPs``: what it saves, nothing else."""

    def __init__(self, needs_grad, saved=()):
        self.needs_grad, self.saved = needs_grad, saved

    def save(self, *arrays):
        self.saved = arrays


def expert_rows(x, groups, n_experts, i, cap):
    """Expert i's rows of x (groups·E·C, d): C rows from each group, (groups·C, d); arrays or Tensors."""
    d = x.shape[-1]
    if groups == 1:
        return x[i * cap:(i + 1) * cap]
    return x.reshape(groups, n_experts * cap, d)[:, i * cap:(i + 1) * cap].reshape(groups * cap, d)


def join_rows(outs, groups, cap, shape, concat=None):
    """The inverse of ``expert_rows`` over every expert: (groups·C, d) each -> ``shape`` (``concat``:
    ``ops.concat`` for Tensors)."""
    concat = concat or backend_of(outs[0]).xp.concatenate
    if groups == 1:
        return concat(outs, axis=0)
    return concat([o.reshape(groups, cap, shape[-1]) for o in outs], axis=1).reshape(*shape)


class ExpertMLPs(Function):
    """Every local expert's MLP (Linear, GELU, Linear) on its rows, as one op: ``x`` (groups·E·C, d)
    holds ``groups`` blocks (one per sender under EP) of the E experts' C rows; ``params`` each
    expert's (fc.weight, fc.bias, proj.weight, proj.bias). ``Linear`` and ``Gelu`` per expert: the
    expert modules' own arithmetic (fast MoE kernels run a grouped GEMM instead)."""

    compilable = True

    @staticmethod
    def forward(ctx, x, *params, groups, cap):
        n_experts, ng = len(params) // 4, ctx.needs_grad
        outs, saved = [], []
        for i in range(n_experts):
            want = ng[1 + 4 * i:5 + 4 * i]
            w1, b1, w2, b2 = params[4 * i:4 * i + 4]
            fc, act, proj = _Step((ng[0], *want[:2])), _Step((True,)), _Step((True, *want[2:]))
            h = Gelu.forward(act, Linear.forward(fc, expert_rows(x, groups, n_experts, i, cap), w1, b1))
            outs.append(Linear.forward(proj, h, w2, b2))
            saved += [*fc.saved, *act.saved, *proj.saved]
        ctx.save(*saved)
        ctx.groups, ctx.cap, ctx.x_shape = groups, cap, x.shape
        return join_rows(outs, groups, cap, x.shape)

    @staticmethod
    def backward(ctx, g):
        ng, saved = ctx.needs_grad, ctx.saved
        n_experts = (len(ng) - 1) // 4
        gxs, grads = [], []
        for i in range(n_experts):
            want = ng[1 + 4 * i:5 + 4 * i]
            s = saved[6 * i:6 * i + 6]
            fc, act, proj = _Step((ng[0], *want[:2]), s[0:2]), _Step((True,), s[2:4]), \
                _Step((True, *want[2:]), s[4:6])
            gh, gw2, gb2 = Linear.backward(proj, expert_rows(g, ctx.groups, n_experts, i, ctx.cap))
            gx, gw1, gb1 = Linear.backward(fc, Gelu.backward(act, gh))
            gxs.append(gx)
            grads += [gw1, gb1, gw2, gb2]
        gx = join_rows(gxs, ctx.groups, ctx.cap, ctx.x_shape) if ng[0] else None
        return (gx, *grads)


class LoadBalancingLoss(Function):
    """The Switch load-balancing loss E · Σ_e f_e · P_e, P_e = mean_n probs[n, e]; ``f`` (E,) is a
    count, without gradient, from the host (on JAX an argument of the compiled op, as an index is:
    no separate device copy)."""

    compilable = True

    @staticmethod
    def forward(ctx, probs, f, n_experts):
        f = backend_of(probs).xp.asarray(f)  # CuPy: onto the device (it will not mix NumPy in)
        ctx.save(f)
        ctx.e, ctx.shape = n_experts, probs.shape
        return (probs.mean(axis=(0,)) * f).sum(axis=(0,)) * n_experts

    @staticmethod
    def backward(ctx, g):
        (f,) = ctx.saved
        xp = backend_of(g).xp
        gp = xp.broadcast_to(g * ctx.e, f.shape) * f / ctx.shape[0]
        return xp.broadcast_to(gp, ctx.shape), None, None


class RouterZLoss(Function):
    """The router z-loss mean_n(logsumexp(logits[n])²), the logsumexp shifted by each row's max."""

    compilable = True

    @staticmethod
    def forward(ctx, logits):
        xp = backend_of(logits).xp
        m = logits.max(axis=-1, keepdims=True)
        ex = xp.exp(logits - m)
        s = ex.sum(axis=(1,), keepdims=True)
        lse = xp.log(s) + m
        ctx.save(ex, s, lse)
        return (lse * lse).mean(axis=(0, 1))

    @staticmethod
    def backward(ctx, g):
        ex, s, lse = ctx.saved
        xp = backend_of(g).xp
        g_lse = xp.broadcast_to(g / lse.shape[0], lse.shape)
        g_lse = g_lse * lse + g_lse * lse  # d(lse·lse): both factors
        return xp.broadcast_to(g_lse / s, ex.shape) * ex
