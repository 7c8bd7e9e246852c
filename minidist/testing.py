"""Helpers for tests, lessons and exercises: the serial twin, state comparison, gradient checks.

* ``train_steps(model, batches, opt)``: the one training loop of every serial twin (and of lesson 1):
  loss, backward, step, zero_grad for each batch; returns the losses.
* ``train_serial(cfg, batches, lr, optimizer)``: a fresh GPT trained by ``train_steps`` on the whole
  global batches -- what every parallel run must equal. Returns (host state dict, losses).
* ``max_state_diff(a, b)``: the largest absolute difference of two state dicts.
* ``adamw_tolerance(lr, steps)``: how far float32 parameters may drift from the serial twin's after
  AdamW steps that differ only in summation order.
* ``gradcheck`` / ``numerical_grads``: autograd against central differences.
"""

from __future__ import annotations

import numpy as np

from minidist.accel.backend import backend_of, get_backend
from minidist.autograd.tensor import Tensor
from minidist.nn import GPT
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


def numerical_grads(fn, arrays, weights, eps=1e-6, backend="numpy"):
    """Central differences of sum(fn(*arrays) * weights) w.r.t. each float array (host float64)."""
    be = get_backend(backend)
    grads = []
    for a in arrays:
        if not np.issubdtype(a.dtype, np.floating):
            grads.append(None)
            continue
        g = np.zeros_like(a)
        flat = a.reshape(-1)
        for j in range(flat.size):
            old = flat[j]
            vals = []
            for step in (eps, -eps):
                flat[j] = old + step
                args = [Tensor(be.from_host(x.copy())) for x in arrays]
                vals.append(float((be.to_host(fn(*args).data) * weights).sum()))
            flat[j] = old
            g.reshape(-1)[j] = (vals[0] - vals[1]) / (2 * eps)
        grads.append(g)
    return grads


def gradcheck(fn, arrays, backend="numpy", eps=1e-6, atol=1e-6, rtol=1e-5, seed=0):
    """Compare autograd gradients of ``fn`` (Tensors -> Tensor) with central differences.

    ``arrays`` are float64 NumPy arrays (non-float ones, e.g. indices, get no gradient). Raises
    AssertionError naming the input and the largest difference; returns the analytic gradients.
    """
    be = get_backend(backend)
    arrays = [np.array(a) for a in arrays]
    inputs = [Tensor(be.from_host(a), requires_grad=np.issubdtype(a.dtype, np.floating)) for a in arrays]
    out = fn(*inputs)
    weights = np.random.default_rng(seed).standard_normal(out.shape)
    (out * Tensor(be.from_host(weights.astype(out.dtype)))).sum().backward()
    numeric = numerical_grads(fn, arrays, weights, eps, backend)
    analytic = []
    for k, (t, num) in enumerate(zip(inputs, numeric)):
        if num is None:
            analytic.append(None)
            continue
        ana = np.zeros_like(num) if t.grad is None else backend_of(t.grad).to_host(t.grad)
        np.testing.assert_allclose(ana, num, atol=atol, rtol=rtol,
                                   err_msg=f"gradient of input {k} (shape {num.shape}) is wrong")
        analytic.append(ana)
    return analytic
