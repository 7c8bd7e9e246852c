"""Global-norm gradient clipping: √(Σ‖g‖²) over every gradient, and every gradient scaled to a cap."""

from __future__ import annotations

import math

from minidist.accel import compiled
from minidist.nn.optim.optimizer import check_hyper


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
