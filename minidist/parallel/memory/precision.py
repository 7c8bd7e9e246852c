"""Mixed precision: fp32 master weights, compute in bf16 or fp16, a dynamic loss scaler for fp16.

The recipe of Micikevicius et al. 2018, "Mixed Precision Training": the optimizer owns fp32 master
weights while the model computes with a low-precision copy (``autocast``: products accumulate in
fp32; LayerNorm statistics, the softmax and the loss run in fp32). fp16's 5 exponent bits let small
gradients underflow, so the loss is multiplied by a scale S before backward and the gradients are
divided by S in fp32 (``DynamicLossScaler``); bf16 needs no scale. With several ranks a skipped step
must be unanimous: the inf/NaN flag is agreed over every group that shares the parameters before
any rank steps, or the replicas silently diverge.

This file is ``MixedPrecision``, the training step; the compute copy is ``autocast.py`` and the
scaler with the agreed flag ``loss_scale.py``, both re-exported here. Chapter 7
(lessons/07-mixed-precision.md) has the numbers: bits, bytes, and why each piece is needed.
"""

from __future__ import annotations

import itertools

import numpy as np

from minidist.accel import compiled
from minidist.accel.backend import backend_of
from minidist.autograd import ops
from minidist.autograd.tensor import Tensor, no_grad
from minidist.comm import all_reduce
from minidist.parallel.memory.autocast import (
    DTYPES,
    _cast_all,
    _to_fp32,
    autocast,
    bfloat16,
    low_dtype,
    remove_autocast,
    round_to_bf16,
)
from minidist.parallel.memory.loss_scale import DynamicLossScaler, _unscale, found_inf_across, has_inf_or_nan

__all__ = ["DTYPES", "DynamicLossScaler", "MixedPrecision", "autocast", "bfloat16", "found_inf_across",
           "has_inf_or_nan", "low_dtype", "remove_autocast", "round_to_bf16"]


class MixedPrecision:
    """fp32 master weights for ``model`` (which is cast to ``dtype`` and autocast) and the step.

        mp = MixedPrecision(model, "fp16", groups=[dp, tp, pp])
        opt = AdamW(mp.master_params, lr=...)           # the optimizer sees fp32 masters only
        loss = mp.loss(idx, targets); mp.backward(loss)
        mp.all_reduce_grads(dp)                         # optional: in low precision
        stepped = mp.step(opt)                          # unscale, agree on inf/NaN, step or skip

    ``scaler`` defaults to a ``DynamicLossScaler`` for fp16 and None (no scaling) otherwise.
    ``loss_fn(logits, targets)`` is the loss of the (fp32-cast) logits: by default the model's own
    ``loss_fn`` if it has one (``TPGPT.loss_fn``: vocabulary-parallel cross-entropy of this rank's
    slice of the logits), else ``ops.cross_entropy`` of full logits. ``groups``: where the inf/NaN
    flag is agreed; None (the default) means every group that shares the parameters
    (``agreement_groups``); a list is used as given (``[]``: each rank decides alone -- only
    right on one process). Add the pipeline group yourself: stages share no parameters.
    """

    def __init__(self, model, dtype="bf16", scaler="auto", groups=None, loss_fn=None):
        self.dtype = low_dtype(dtype)
        if scaler == "auto":
            scaler = DynamicLossScaler() if self.dtype == np.float16 else None
        self.scaler = scaler
        self.groups = None if groups is None else list(groups)
        named = list(model.named_parameters())
        self.master_params = [Tensor(m, requires_grad=True, name=n)  # on p's device: the model's
                              for (n, _), m in zip(named, _cast_all([p.data for _, p in named], np.float32))]
        self.model = autocast(model, self.dtype)
        self.params = model.parameters()
        self.last_found_inf = False
        self.loss_fn = loss_fn or getattr(model, "loss_fn", None) or ops.cross_entropy
        self._reduced_over: list = []  # groups all_reduce_grads averaged over: they share the parameters

    @property
    def scale(self) -> float:
        return 1.0 if self.scaler is None else self.scaler.scale

    def loss(self, idx, targets):
        """``loss_fn`` (cross-entropy) in fp32 of the low-precision model's logits."""
        return self.loss_fn(_to_fp32(self.model(idx)), targets)

    def backward(self, loss):
        """Backward of ``loss · S``: the seed gradient is S, so every gradient is S times larger."""
        loss.backward(np.full(loss.shape, self.scale, dtype=loss.dtype))

    def all_reduce_grads(self, comm):
        """Average the low-precision gradients over ``comm``: half the bytes of fp32 on the wire.

        Each rank divides by p *before* the sum (DDP's gradient pre-division): a loss-scaled fp16
        gradient summed over p ranks would otherwise overflow p times sooner. The gradients of one
        dtype go as one flat buffer: one collective, which ``auto`` can make bandwidth-optimal,
        instead of one small all-reduce per tensor."""
        if all(c is not comm for c in self._reduced_over):
            self._reduced_over.append(comm)
        with_grad = [p for p in self.params if p.grad is not None]
        for _, run in itertools.groupby(with_grad, key=lambda p: p.dtype):
            run = list(run)
            flat = _flat_over_p(backend_of(run[0].grad).xp, [p.grad for p in run], 1.0 / comm.size)
            flat = all_reduce(comm, flat, op="sum")  # in the low dtype (op="mean" is for fp32/fp64)
            for p, g in zip(run, _views(flat, tuple(p.shape for p in run))):
                p.grad = g

    def step(self, optimizer) -> bool:
        """Unscale into the fp32 masters, agree on inf/NaN (``agreement_groups``), step or skip; True if
        stepped. Low-precision grads are cleared; the model gets the new masters, rounded."""
        inv = np.float32(1.0 / self.scale)  # (an argument of the compiled call: a new scale compiles nothing)
        grads = [p.grad for p in self.params]
        unscaled, nonfinite = grads, False
        if any(g is not None for g in grads):
            xp = backend_of(next(g for g in grads if g is not None)).xp
            unscaled, nonfinite = _unscale(xp, grads, inv)
        for m, p, g in zip(self.master_params, self.params, unscaled):
            m.grad, p.grad = g, None
        found = found_inf_across(bool(nonfinite), self.agreement_groups())
        self.last_found_inf = found
        if self.scaler is not None:
            self.scaler.update(found)
        if not found:
            optimizer.step()
            with no_grad():
                for p, low in zip(self.params, _cast_all([m.data for m in self.master_params], self.dtype)):
                    p.data = low
        for m in self.master_params:
            m.grad = None
        return not found

    def agreement_groups(self) -> list:
        """The groups the inf/NaN flag is agreed over: ``groups`` if given, else every group that
        shares the parameters, found in model order (the same list on every rank):

        * a gradient sync hooked on the parameters (a post-accumulate hook that is a method of an
          object with a ``comm``: DDP's ``grad_ready``) -- its data-parallel group;
        * a layer with a ``comm`` and a ``sequence_parallel`` flag -- its tensor-parallel group;
        * every group ``all_reduce_grads`` averaged over."""
        if self.groups is not None:
            return self.groups
        found = {}
        for p in self.params:
            for hook in p._post_hooks or ():
                comm = getattr(getattr(hook, "__self__", None), "comm", None)
                if comm is not None:
                    found.setdefault(id(comm), comm)
        for _, m in self.model.named_modules():
            comm = getattr(m, "comm", None)
            if comm is not None and hasattr(m, "sequence_parallel"):  # a tensor-parallel layer
                found.setdefault(id(comm), comm)
        for comm in self._reduced_over:
            found.setdefault(id(comm), comm)
        return list(found.values())


@compiled.pure  # on JAX one compiled call: the concatenation and the division by p
def _flat_over_p(xp, grads, factor):
    """The gradients as one flat array, each element times ``factor`` (1/p), in their own dtype."""
    flat = xp.concatenate([g.reshape(-1) for g in grads])
    return flat * flat.dtype.type(factor)


@compiled.pure  # on JAX one compiled call, not a slice and a reshape program per parameter
def _views(flat, shapes) -> list:
    """The inverse of the concatenation: ``flat`` cut into arrays of ``shapes``."""
    ends = np.cumsum([0] + [int(np.prod(s)) for s in shapes])
    return [flat[a:b].reshape(s) for a, b, s in zip(ends[:-1], ends[1:], shapes)]
