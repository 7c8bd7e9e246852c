"""Optimizers (SGD with momentum, AdamW), a warmup + cosine schedule, global-norm clipping.

Optimizers read ``p.grad`` and write ``p.data``. With NumPy and CuPy the state and the parameters
are updated in place (no step-sized temporaries); with JAX, whose arrays are immutable, the same
formulas produce new arrays. ``state_dict``/``load_state_dict`` hold host copies so a checkpoint
can be written, and restored on another backend, exactly.
"""

from __future__ import annotations

import math

import numpy as np

from minidist.accel import compiled
from minidist.accel.backend import backend_of


def check_hyper(owner: str, name: str, value, low: float, high: float | None = None,
                open_low: bool = False) -> float:
    """``value`` as a float, or a ValueError naming ``owner``'s argument ``name`` and the allowed
    range: finite, >= ``low`` (> with ``open_low``), < ``high`` if given. NaN and inf never pass."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{owner}: {name} must be a number, got {value!r}")
    value = float(value)
    below = value <= low if open_low else value < low
    if not math.isfinite(value) or below or (high is not None and value >= high):
        allowed = ("(" if open_low else "[") + f"{low:g}, " + (f"{high:g})" if high is not None else "inf)")
        raise ValueError(f"{owner}: {name} must be a finite number in {allowed}, got {value}")
    return value


class Optimizer:
    def __init__(self, params, lr: float):
        self.params = [p for p in params]
        if not self.params:
            raise ValueError("optimizer got an empty parameter list")
        self.lr = check_hyper(type(self).__name__, "lr", lr, low=0.0)
        self.step_count = 0
        self.state: list[dict] = [{} for _ in self.params]

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def step(self):
        self.step_count += 1
        self.apply_updates([(p, st) for p, st in zip(self.params, self.state)
                    if p.grad is not None and p.requires_grad])

    def apply_updates(self, live):
        """This step's update of the (parameter, state) pairs ``live``: on JAX one compiled call
        (``update_all``), elsewhere one parameter at a time (``update``)."""
        if live and compiled.compiles(live[0][0].data):
            self.update_all(live)  # JAX: the whole update as one compiled call
        else:
            for p, st in live:
                self.update(p, st)

    def update(self, p, state):  # pragma: no cover - abstract
        raise NotImplementedError

    def update_all(self, live):
        """Update every (parameter, state) pair of ``live`` at once; by default one by one."""
        for p, st in live:
            self.update(p, st)

    def state_dict(self) -> dict:
        return {"lr": self.lr, "step_count": self.step_count,
                "state": [{k: np.array(backend_of(v).to_host(v)) for k, v in st.items()}
                          for st in self.state]}

    def load_state_dict(self, sd: dict):
        if len(sd["state"]) != len(self.params):
            raise ValueError(f"optimizer state has {len(sd['state'])} entries, this optimizer has "
                             f"{len(self.params)} parameters")
        self.lr, self.step_count = sd["lr"], sd["step_count"]
        self.state = [{k: p.backend.from_host(np.array(v)) for k, v in st.items()}
                      for p, st in zip(self.params, sd["state"])]
        return self


class SGD(Optimizer):
    """p -= lr · (g + wd·p), with heavy-ball momentum buf = μ·buf + g when momentum > 0."""

    def __init__(self, params, lr=0.01, momentum=0.0, weight_decay=0.0):
        super().__init__(params, lr)
        self.momentum = check_hyper("SGD", "momentum", momentum, low=0.0, high=1.0)
        self.weight_decay = check_hyper("SGD", "weight_decay", weight_decay, low=0.0)

    def update(self, p, st):
        g = p.grad
        if self.weight_decay:
            g = g + self.weight_decay * p.data
        if self.momentum:
            buf = st.get("momentum")
            g = st["momentum"] = g if buf is None else self.momentum * buf + g
        p.data = _sub_scaled(p.data, g, self.lr)

    def update_all(self, live):
        """JAX: every parameter's SGD step in one compiled call (``compiled.fused``)."""
        ps = [p for p, _ in live]
        if self.momentum:
            for p, st in live:  # mu·0 + g = g: the first step is the formula's too
                st.setdefault("momentum", compiled.zeros_like(p.data))
            bufs = [st["momentum"] for _, st in live]
            new = compiled.fused("sgd", _sgd_momentum_arrays,
                                   [[p.data for p in ps], [p.grad for p in ps], bufs],
                                   (self.lr, self.momentum, self.weight_decay), donate=(2,))
            for (p, st), (data, buf) in zip(live, new):
                p.data, st["momentum"] = data, buf
        else:
            new = compiled.fused("sgd", _sgd_arrays, [[p.data for p in ps], [p.grad for p in ps]],
                                   (self.lr, self.weight_decay))
            for p, data in zip(ps, new):
                p.data = data


def _sgd_arrays(p, g, lr, wd):
    """SGD without momentum on immutable arrays: what ``SGD.update`` computes (wd·p added even when
    wd is 0: g + 0·p == g)."""
    return (p - lr * (g + wd * p)).astype(p.dtype)


def _sgd_momentum_arrays(p, g, buf, lr, mu, wd):
    g = g + wd * p
    buf = mu * buf + g
    return (p - lr * buf).astype(p.dtype), buf


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
        """JAX: every parameter's AdamW step -- m, v and p -- in ONE compiled call per step, with
        the step's scalars as arguments (a schedule's new lr reuses the program) and m and v's
        buffers donated to their new values."""
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


def _sub_scaled(data, g, lr):
    if backend_of(data).inplace:
        data -= lr * g
        return data
    return (data - lr * g).astype(data.dtype)


def make_optimizer(name: str, params, lr: float, **kw) -> Optimizer:
    """An optimizer by name, so a parallel run and its serial twin build the same one: "sgd", or
    "adamw" (weight decay 0 unless ``weight_decay=`` is given)."""
    if name == "sgd":
        return SGD(params, lr=lr, **kw)
    if name == "adamw":
        return AdamW(params, lr=lr, **{"weight_decay": 0.0, **kw})
    raise ValueError(f"unknown optimizer {name!r}: use 'sgd' or 'adamw'")


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Learning-rate multiplier: linear warmup to 1 over ``warmup`` steps, cosine down to ``min_ratio``."""
    if step < warmup:
        return (step + 1) / warmup
    if step >= total:
        return min_ratio
    progress = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class WarmupCosine:
    """Sets ``optimizer.lr`` from ``base_lr`` and :func:`warmup_cosine` at every ``step()``."""

    def __init__(self, optimizer, warmup: int, total: int, min_ratio: float = 0.1):
        if int(warmup) != warmup or warmup < 0 or int(total) != total or total < 1:
            raise ValueError(f"WarmupCosine: need integers warmup >= 0 and total >= 1, got warmup={warmup}, "
                             f"total={total}")
        check_hyper("WarmupCosine", "min_ratio", min_ratio, low=0.0, high=1.0 + 1e-12)
        self.opt, self.base_lr = optimizer, optimizer.lr
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio
        self.last = 0
        self.opt.lr = self.base_lr * warmup_cosine(0, warmup, total, min_ratio)

    def step(self):
        self.last += 1
        self.opt.lr = self.base_lr * warmup_cosine(self.last, self.warmup, self.total, self.min_ratio)

    def state_dict(self):
        return {"last": self.last, "base_lr": self.base_lr}

    def load_state_dict(self, sd):
        self.last, self.base_lr = sd["last"], sd["base_lr"]
        self.opt.lr = self.base_lr * warmup_cosine(self.last, self.warmup, self.total, self.min_ratio)


def global_grad_norm(params) -> float:
    """√(Σ‖g‖²) over every parameter's gradient, summed in float64 on the gradients' device and
    brought to the host once (no float64 copy of each gradient, no device sync per parameter)."""
    grads = [p.grad for p in params if p.grad is not None]
    return math.sqrt(float(_sum_of_squares(grads))) if grads else 0.0


@compiled.pure  # on JAX one compiled call for every gradient, not two programs per shape
def _sum_of_squares(grads):
    return sum((g * g).sum(dtype="float64") for g in grads)


def clip_grad_norm(params, max_norm: float, norm: float | None = None) -> float:
    """Scale all gradients so their global norm is at most ``max_norm``; returns the norm before.

    Pass ``norm`` when it was computed elsewhere (e.g. summed across tensor-parallel ranks).
    """
    check_hyper("clip_grad_norm", "max_norm", max_norm, low=0.0, open_low=True)
    params = list(params)
    norm = global_grad_norm(params) if norm is None else norm
    if norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        live = [p for p in params if p.grad is not None]
        if live and compiled.compiles(live[0].grad):  # JAX: one compiled call, the scale an argument
            for p, g in zip(live, compiled.fused("clip", _scaled, [[p.grad for p in live]], (scale,))):
                p.grad = g
        else:
            for p in live:
                p.grad = _scaled(p.grad, scale)
    return norm


def _scaled(g, scale):
    return (g * scale).astype(g.dtype)
