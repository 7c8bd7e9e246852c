"""Mixed precision: fp32 master weights, compute in bf16 or fp16, a dynamic loss scaler for fp16.

The recipe (Micikevicius et al. 2018, "Mixed Precision Training"):

1. The optimizer owns **fp32 master weights**; the model computes with a **low-precision copy**
   (``autocast``): parameters and activations stored (and gradients communicated) in bf16 or fp16.
   Matmuls take low-precision inputs and **accumulate in fp32**, then round their output -- what a
   tensor core does, emulated here by casting the inputs up, multiplying in fp32 and casting down.
   LayerNorm statistics, the attention softmax and the loss run in fp32.
2. fp16 has 5 exponent bits: small gradients underflow to zero. So the loss is multiplied by a
   **scale** S before backward and the gradients divided by S in fp32. ``DynamicLossScaler``
   starts at S = 2^16, halves S and skips the step when a gradient is inf/NaN, and doubles S after
   ``growth_interval`` clean steps. bf16 has fp32's 8 exponent bits and needs no scaling.
3. With several ranks the skip must be unanimous: ``found_inf_across(flag, groups)`` takes the max
   of the flag over every group before any rank steps; a rank that stepped while another skipped
   would silently diverge. By default ``MixedPrecision`` agrees over every group that shares the
   parameters it can see (``agreement_groups``): the tensor-parallel group of its layers, every
   group given to ``all_reduce_grads`` (a DDP's averaged gradients are equal on every replica).
   Only an explicit ``groups=[...]`` narrows (or widens, e.g. with the pipeline group) that set.

bf16 is ``ml_dtypes.bfloat16``; ``round_to_bf16`` writes its round-to-nearest-even out by hand.

This file is ``MixedPrecision``, the training step; the compute copy (``autocast``) is
``minidist/parallel/memory/autocast.py`` and the loss scaler with the agreed flag
``minidist/parallel/memory/loss_scale.py``, both re-exported here.
"""

from __future__ import annotations

import numpy as np

from minidist.accel.backend import backend_of
from minidist.autograd import ops
from minidist.autograd.tensor import Tensor, no_grad
from minidist.parallel.data.compress.cast import cast_all_reduce
from minidist.parallel.data.ddp import build_buckets
from minidist.parallel.memory.autocast import (
    DTYPES,
    _cast_all,
    _to_fp32,
    autocast,
    bfloat16,
    dtype_technique,
    low_dtype,
    remove_autocast,
    round_to_bf16,
)
from minidist.parallel.memory.loss_scale import DynamicLossScaler, _unscale, found_inf_across, has_inf_or_nan

__all__ = ["DTYPES", "DynamicLossScaler", "MixedPrecision", "autocast", "bfloat16", "dtype_technique",
           "found_inf_across", "has_inf_or_nan", "low_dtype", "remove_autocast", "round_to_bf16"]


# ---------------------------------------------------------------------------------------------
# the training step
# ---------------------------------------------------------------------------------------------
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

    def agreement_groups(self) -> list:
        """The groups the inf/NaN flag is agreed over: ``groups`` if given, else every group that
        shares the parameters -- the tensor-parallel groups of its layers and the groups
        ``all_reduce_grads`` used (the same
        list on every rank: found in the same model order)."""
        if self.groups is not None:
            return self.groups
        found = {}
        for _, m in self.model.named_modules():
            comm = getattr(m, "comm", None)
            if comm is not None and hasattr(m, "sequence_parallel"):  # a tensor-parallel layer
                found.setdefault(id(comm), comm)
        for comm in self._reduced_over:
            found.setdefault(id(comm), comm)
        return list(found.values())

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
        gradient summed over p ranks would otherwise overflow p times sooner. (The comm layer's
        op="mean" is for fp32/fp64 only, so it is a multiply then a sum, in the low dtype.)
        The gradients go as one flat buffer per dtype (``Bucket``, as DDP's): one collective, which
        ``auto`` can make bandwidth-optimal, instead of one small all-reduce per tensor."""
        if all(c is not comm for c in self._reduced_over):
            self._reduced_over.append(comm)
        for b in build_buckets([p for p in self.params if p.grad is not None], float("inf")):
            flat = b.flatten([p.grad for p in b.params])
            flat = cast_all_reduce(comm, flat, flat.dtype)  # the cast-compression hook's arithmetic
            for p, v in zip(b.params, b.views(flat)):
                p.grad = v

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
