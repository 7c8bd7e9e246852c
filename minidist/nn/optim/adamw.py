"""AdamW, the optimizer every chapter trains with: ``adamw_update`` in place on NumPy and CuPy (one
temporary, reused by every line); ``adamw_arrays``, the same operations in the same order on immutable
arrays, as one compiled call over every parameter on JAX (``update_all``, ``minidist.accel.compiled``).
"""

from __future__ import annotations

import math

from minidist.accel import compiled
from minidist.accel.backend import backend_of
from minidist.nn.optim.optimizer import Optimizer, check_hyper


class AdamW(Optimizer):
    """Adam with decoupled weight decay (Loshchilov & Hutter):

        m = β1·m + (1-β1)·g;  v = β2·v + (1-β2)·g²
        p -= lr · (m/(1-β1ᵗ) / (√(v/(1-β2ᵗ)) + ε) + wd·p)
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        super().__init__(params, lr)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise TypeError(f"AdamW: betas must be a pair (beta1, beta2), got {betas!r}")
        self.betas = tuple(check_hyper("AdamW", f"betas[{i}]", b, low=0.0, high=1.0)
                           for i, b in enumerate(betas))
        self.eps = check_hyper("AdamW", "eps", eps, low=0.0, open_low=True)
        self.weight_decay = check_hyper("AdamW", "weight_decay", weight_decay, low=0.0)

    def update(self, p, st):
        adamw_update(p, st, self.lr, self.betas, self.eps, self.weight_decay, self.step_count)

    def update_all(self, live):
        """JAX: every parameter's step in ONE compiled call, the step's scalars as arguments (a new lr
        reuses the program), m and v's buffers donated to their new values."""
        for p, st in live:
            if "m" not in st:
                st["m"], st["v"] = compiled.zeros_like(p.data), compiled.zeros_like(p.data)
        ps = [p for p, _ in live]
        new = compiled.fused("adamw", adamw_arrays,
                               [[p.data for p in ps], [p.grad for p in ps], [st["m"] for _, st in live],
                                [st["v"] for _, st in live]],
                               (self.lr, *_adamw_scalars(self.lr, self.betas, self.eps, self.step_count),
                                *self.betas, self.weight_decay), donate=(2, 3))
        for (p, st), (data, m, v) in zip(live, new):
            p.data, st["m"], st["v"] = data, m, v


def adamw_update(p, st, lr, betas, eps, weight_decay, t):
    """One AdamW step of parameter ``p`` with state dict ``st`` ("m", "v"); written once for all."""
    b1, b2 = betas
    g = p.grad
    be = backend_of(p.data)
    xp = be.xp
    if "m" not in st:
        st["m"] = xp.zeros_like(p.data)
        st["v"] = xp.zeros_like(p.data)
    step_size, eps_hat = _adamw_scalars(lr, betas, eps, t)
    if be.inplace:  # adamw_arrays' formula in its order, in place: one temporary, reused by every line
        m, v, data = st["m"], st["v"], p.data
        m *= b1
        tmp = g * (1 - b1)
        m += tmp
        v *= b2
        xp.multiply(g, g, out=tmp)
        tmp *= 1 - b2
        v += tmp
        xp.sqrt(v, out=tmp)
        tmp += eps_hat
        xp.divide(m, tmp, out=tmp)
        if weight_decay:
            data *= 1 - lr * weight_decay
        tmp *= step_size
        data -= tmp
    elif compiled.compiles(p.data):  # compiled, as AdamW.update_all is: the same program's rounding
        [(p.data, st["m"], st["v"])] = compiled.fused(
            "adamw", adamw_arrays, [[p.data], [g], [st["m"]], [st["v"]]],
            (lr, step_size, eps_hat, b1, b2, weight_decay))
    else:
        p.data, st["m"], st["v"] = adamw_arrays(p.data, g, st["m"], st["v"], lr, step_size, eps_hat,
                                                b1, b2, weight_decay)


def _adamw_scalars(lr, betas, eps, t):
    """(step size, ε̂) of step ``t``: m / (√(v / c2) + ε) = √c2 · m / (√v + ε·√c2), so the bias
    corrections fold into two scalars."""
    root_c2 = math.sqrt(1 - betas[1] ** t)
    return lr * root_c2 / (1 - betas[0] ** t), eps * root_c2


def adamw_arrays(p, g, m, v, lr, step_size, eps_hat, b1, b2, wd):
    """One AdamW step on immutable arrays (JAX, eager or traced by ``compiled.fused``): the new
    (p, m, v). The same operations in the same order as ``adamw_update``'s in-place NumPy branch."""
    xp = backend_of(p).xp
    m = m * b1 + g * (1 - b1)
    v = v * b2 + (g * g) * (1 - b2)
    update = m / (xp.sqrt(v) + eps_hat) * step_size
    return (p * (1 - lr * wd) - update).astype(p.dtype), m, v
