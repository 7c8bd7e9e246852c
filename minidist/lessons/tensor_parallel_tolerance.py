"""Lesson 4's verdict: how far a tensor-parallel run may be from its serial twin, and the check.

The ranks add partial products in another order than one process does, so the two runs differ by
rounding: ``rounding_bound`` derives the bound (2u·sqrt(K), K the multiply-adds feeding one number);
``first_gradients`` takes the first step's loss and gradients, where only summation order differs;
``compare`` holds gradients and every step's loss to the bound and the parameters after AdamW to
``minidist.nn.serial.adamw_tolerance``.
"""

from __future__ import annotations

import math

import numpy as np

from minidist.autograd import random as mrandom
from minidist.nn.serial import max_state_diff


def rounding_bound(b: int, s: int, h: int, vocab: int, dtype) -> float:
    """Relative bound on how far two summation orders of one forward + backward may differ.

    One rounding errs by at most u·|x| (u = eps/2: 2^-24 in float32). A weight's gradient sums the
    b·s tokens' contributions, each a product of vectors that are themselves sums of up to
    max(4h, vocab) terms (MLP, head): K = b·s·max(4h, vocab) multiply-adds feed one number. Errors of
    random sign grow like √K·u (the probabilistic bound of Higham & Mary, 2019), and both runs are
    rounded: 2·u·√K, relative to the quantity's scale (the largest |g| of each gradient tensor, |loss|).
    For b=4, s=32, h=64, vocab=256 in float32: 2.2e-05 (measured: ~10 u = 6e-07).
    """
    u = float(np.finfo(dtype).eps) / 2
    return 2 * u * math.sqrt(b * s * max(4 * h, vocab))


def first_gradients(model, batch, seed: int, names=None):
    """Loss and host float64 gradients of one forward + backward (dropout seeded like training),
    before any step: where the two runs differ by summation order only, so ``rounding_bound`` holds."""
    mrandom.manual_seed(seed)
    loss = model.loss(*batch)
    loss.backward()
    grads = {n: np.asarray(p.backend.to_host(p.grad), np.float64) for n, p in model.named_parameters()}
    model.zero_grad()
    return float(loss.item()), grads


def compare(twin, got, rel: float, param_tol: float):
    """Rank 0's verdict on one run against the serial twin.

    ``twin`` and ``got``: dicts with ``loss0``, ``grads`` (first_gradients), ``losses`` (per step) and
    ``params`` (after training, serial names). Returns (ok, max|dloss|, worst relative gradient
    difference, max|dparam|): gradients within ``rel``·max|g| of each tensor, every step's loss within
    ``rel``·|loss|, parameters within ``param_tol``."""
    dgrad = max(float(np.max(np.abs(got["grads"][k] - g))) / max(float(np.max(np.abs(g))), 1e-30)
                for k, g in twin["grads"].items())
    pairs = list(zip([got["loss0"]] + got["losses"], [twin["loss0"]] + twin["losses"]))
    dloss = max(abs(a - c) for a, c in pairs)
    loss_ok = all(abs(a - c) <= rel * abs(c) for a, c in pairs)
    dparam = max_state_diff(got["params"], twin["params"])
    return dgrad <= rel and loss_ok and dparam <= param_tol, dloss, dgrad, dparam
