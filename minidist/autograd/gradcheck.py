"""Gradient checks: autograd's gradients against central differences, for tests and exercise graders."""

from __future__ import annotations

import numpy as np

from minidist.accel.backend import backend_of, get_backend
from minidist.autograd.tensor import Tensor


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
