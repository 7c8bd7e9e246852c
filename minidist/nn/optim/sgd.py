"""SGD with heavy-ball momentum and weight decay: p -= lr · (g + wd·p), or the momentum buffer's step."""

from __future__ import annotations

from minidist.accel import compiled
from minidist.accel.backend import backend_of
from minidist.nn.optim.optimizer import Optimizer, check_hyper


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


def _sub_scaled(data, g, lr):
    if backend_of(data).inplace:
        data -= lr * g
        return data
    return (data - lr * g).astype(data.dtype)
