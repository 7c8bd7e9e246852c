"""The serial twin: the one training loop every parallel result is checked against.

* ``train_steps(model, batches, opt)``: loss, backward, step, zero_grad for each batch (lesson 1's
  loop too); returns the losses.
* ``train_serial(cfg, batches, lr, optimizer)``: a fresh GPT trained by ``train_steps`` on the whole
  global batches -- what every parallel run must equal. Returns (host state dict, losses).
* ``max_state_diff(a, b)``: the largest absolute difference of two state dicts.
* ``adamw_tolerance(lr, steps)``: how far float32 parameters may drift from the serial twin's after
  AdamW steps that differ only in summation order.
"""

from __future__ import annotations

import numpy as np

from minidist.accel.backend import backend_of
from minidist.nn.gpt import GPT
from minidist.nn.optim import clip_grad_norm, make_optimizer


def adamw_tolerance(lr: float, steps: int) -> float:
    """How far the parameters may be apart after ``steps`` AdamW steps of two runs that differ only in
    summation order (float32): 0.1·lr·steps.

    AdamW moves each parameter by lr·m̂/(√v̂+ε), at most ~lr a step whatever the gradient's size. A
    gradient whose true value sits at the rounding level (measured: -2.9e-09 in a tensor whose
    gradients reach 1e-03, with ε = 1e-08) gets an update set by its rounding: up to ±lr, and later
    steps carry the difference on. So no rounding-sized bound exists for parameters; we allow 10% of
    the largest travel (measured in the tensor-parallel lesson: up to 0.8% of it over seeds 0-5),
    while a real bug (a lost microbatch, a missing all-reduce) moves them ~lr a step.
    """
    return 0.1 * lr * steps


def train_steps(model, batches, opt, loss_fn=None, clip=None, schedule=None, on_step=None) -> list[float]:
    """Train ``model`` on each ``(x, y)`` of ``batches`` (a list or any iterable) with optimizer ``opt``.

    Per batch: ``loss = loss_fn(model, x, y)`` (default ``model.loss(x, y)``), backward, gradient
    clipping to global norm ``clip`` (if given), ``opt.step()``, ``schedule.step()`` (if given),
    ``opt.zero_grad()``. ``on_step(i, losses)`` is called after step i with the losses so far.
    Returns the losses as floats.
    """
    losses = []
    for i, (x, y) in enumerate(batches):
        loss = model.loss(x, y) if loss_fn is None else loss_fn(model, x, y)
        loss.backward()
        if clip is not None:
            clip_grad_norm(model.parameters(), clip)
        opt.step()
        if schedule is not None:
            schedule.step()
        opt.zero_grad()
        losses.append(float(loss.item()))
        if on_step is not None:
            on_step(i, losses)
    return losses


def host_state(model) -> dict:
    """Name -> host NumPy copy of every parameter (comparable across backends and ranks)."""
    return {k: np.array(p.backend.to_host(p.data)) for k, p in model.named_parameters()}


def train_serial(cfg, batches, lr: float = 0.1, optimizer: str = "sgd", loss_fn=None, **opt_kw):
    """The serial twin: one GPT of ``cfg``, the whole global batch per step, ``optimizer`` ("sgd" or
    "adamw", ``minidist.nn.optim.make_optimizer``; AdamW without weight decay unless ``weight_decay=``).
    Returns (host state dict, losses)."""
    model = GPT(cfg)
    losses = train_steps(model, batches, make_optimizer(optimizer, model.parameters(), lr, **opt_kw), loss_fn)
    return host_state(model), losses


def max_state_diff(a: dict, b: dict) -> float:
    """Largest absolute difference between two state dicts with the same names and shapes."""
    if a.keys() != b.keys():
        raise KeyError(f"state dicts differ in names: {sorted(a.keys() ^ b.keys())[:5]}")
    host = [(backend_of(a[k]).to_host(a[k]), backend_of(b[k]).to_host(b[k])) for k in a]
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))) for x, y in host)
