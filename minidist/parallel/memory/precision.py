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
   parameters it can see (``agreement_groups``): the data-parallel group of a DDP wrapping the
   model, the tensor-parallel group of its layers, every group given to ``all_reduce_grads``.
   Only an explicit ``groups=[...]`` narrows (or widens, e.g. with the pipeline group) that set.

bf16 is ``ml_dtypes.bfloat16``; ``round_to_bf16`` writes its round-to-nearest-even out by hand.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from minidist.accel import jax_engine
from minidist.accel.backend import backend_of
from minidist.autograd import ops
from minidist.autograd.tensor import Tensor, no_grad
from minidist.comm import all_reduce
from minidist.nn.layers import LayerNorm
from minidist.nn.module import Module
from minidist.parallel.compose import check_compatible, claimed
from minidist.parallel.data.compress.cast import cast_all_reduce
from minidist.parallel.data.ddp import build_buckets

bfloat16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"bf16": bfloat16, "bfloat16": bfloat16, "fp16": np.dtype(np.float16),
          "float16": np.dtype(np.float16), "fp32": np.dtype(np.float32), "float32": np.dtype(np.float32)}


def low_dtype(name) -> np.dtype:
    """"bf16" | "fp16" | "fp32" (or a dtype) -> numpy dtype, with a clear error otherwise."""
    if isinstance(name, str):
        if name not in DTYPES:
            raise ValueError(f"unknown precision {name!r}; use one of bf16, fp16, fp32")
        return DTYPES[name]
    dt = np.dtype(name)
    if dt not in DTYPES.values():
        raise ValueError(f"unsupported compute dtype {dt}; use bfloat16, float16 or float32")
    return dt


def round_to_bf16(x) -> np.ndarray:
    """float32 -> bfloat16 by round-to-nearest-even on the bits (keep the top 16 of 32).

    Add 0x7FFF plus the lowest kept bit, then drop the low 16 bits: halfway cases round to the
    even neighbour; overflow carries into the exponent (to inf when it must). NaNs stay NaN.
    """
    x = np.array(x, dtype=np.float32, order="C")  # keeps 0-d shapes, unlike ascontiguousarray
    bits = x.view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))
    top = (rounded >> 16).astype(np.uint16)
    top = np.where(np.isnan(x), ((bits >> 16) | np.uint32(0x40)).astype(np.uint16), top)  # quiet NaN
    return top.view(bfloat16)


# ---------------------------------------------------------------------------------------------
# the compute copy: low-precision parameters, fp32 accumulation
# ---------------------------------------------------------------------------------------------
def _layer_norm_wrapper(ln, inner, x):
    """LayerNorm statistics in fp32, the output rounded to the low dtype: one op, which casts x, the
    weight and the bias up inside and its output down (``ops.layer_norm(..., compute=float32)``;
    gradients come back in each input's dtype). It computes the layer itself (autocast is the
    innermost wrapper, so nothing inside it is skipped)."""
    return ops.layer_norm(x, ln.weight, ln.bias, ln.eps, compute=np.promote_types(np.float32, x.dtype))


def _to_fp32(t):
    """``t`` as fp32 for what must run in fp32 (a softmax, the loss); already fp32: ``t`` itself."""
    return t if t.dtype == np.float32 else ops.cast(t, np.float32)


def _fp32_output_wrapper(module, inner, x):
    """The attention's qkv projection: low-precision values handed on in fp32, so the attention
    core (its softmax) runs in fp32, as torch.autocast does."""
    return _to_fp32(inner(x))


@jax_engine.pure  # on JAX one compiled call for the whole model, not one cast program per shape
def _cast_all(arrays, dtype) -> list:
    """Every array of ``arrays`` cast to ``dtype``: a new array each (on NumPy and CuPy a copy even
    when the dtype is already ``dtype``: the fp32 masters must not share memory with the model)."""
    return [a.astype(dtype) for a in arrays]


def autocast(model, dtype="bf16"):
    """Make ``model`` compute in ``dtype``; returns the model. Cast the logits to fp32 before the
    loss (``MixedPrecision.loss`` does).

    Its parameters are cast in place. Every product then runs in low precision with fp32
    accumulation by itself: ``ops.linear`` of 2-byte weights is a tensor core's product (so
    ``Linear`` and the tensor-parallel ``ColumnParallelLinear`` / ``RowParallelLinear`` need nothing,
    their communication moves low-precision values). Two ``"autocast"`` forward wrappers (the innermost
    position of ``Module``'s stack) do the rest: LayerNorm computes its statistics in fp32, and an
    attention's qkv projection hands its output on in fp32. ``remove_autocast`` takes them away."""
    dt = low_dtype(dtype)
    check_compatible(model, dtype_technique(dt))
    params = model.parameters()
    for p, low in zip(params, _cast_all([p.data for p in params], dt)):
        p.data = low
    owner = f"autocast ({dt.name})"
    for _, m in model.named_modules():
        if isinstance(m, LayerNorm):
            m.register_forward_wrapper(_layer_norm_wrapper, "autocast", owner)
        qkv = getattr(m, "qkv", None)  # an attention (serial or tensor-parallel)
        if isinstance(qkv, Module):
            qkv.register_forward_wrapper(_fp32_output_wrapper, "autocast", owner)
    return model  # (an Embedding needs nothing: rows of a low-precision table are low precision)


def remove_autocast(model):
    """Remove ``autocast``'s wrappers (the parameters keep their dtype: cast them back yourself)."""
    for _, m in model.named_modules():
        handle = m.forward_wrapper("autocast")
        if handle is not None:
            handle.remove()
    return model


def dtype_technique(dt) -> str:
    """The composition-matrix name of a compute dtype: "bf16", "fp16" (fp32 is no technique)."""
    return {bfloat16: "bf16", np.dtype(np.float16): "fp16"}.get(np.dtype(dt), "fp32")


# ---------------------------------------------------------------------------------------------
# the loss scaler and the agreed inf/NaN flag
# ---------------------------------------------------------------------------------------------
class DynamicLossScaler:
    """S = 2^16 at first; inf/NaN: S /= 2 and skip; ``growth_interval`` clean steps in a row: S *= 2."""

    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                 min_scale=1.0):
        if init_scale <= 0 or growth_factor <= 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
            raise ValueError("DynamicLossScaler needs init_scale > 0, growth_factor > 1, "
                             "0 < backoff_factor < 1, growth_interval >= 1")
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.min_scale = growth_interval, min_scale
        self.clean_steps = 0
        self.skipped = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.clean_steps = 0
            self.skipped += 1
        else:
            self.clean_steps += 1
            if self.clean_steps == self.growth_interval:
                self.scale *= self.growth_factor
                self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped": self.skipped}

    def load_state_dict(self, sd: dict):
        self.scale, self.clean_steps, self.skipped = sd["scale"], sd["clean_steps"], sd["skipped"]
        return self


def has_inf_or_nan(arrays) -> bool:
    """Is any element of any array inf or NaN? (One pass over all of them, one value read back.)"""
    arrays = [a for a in arrays if a is not None]
    return bool(arrays) and bool(_nonfinite(backend_of(arrays[0]).xp, arrays))


@jax_engine.pure
def _nonfinite(xp, arrays):
    """A 0-d boolean array: does any of ``arrays`` hold an inf or NaN?"""
    return ~xp.stack([xp.isfinite(a).all() for a in arrays]).all()


@jax_engine.pure  # on JAX one compiled call per step: the casts, the multiplies and the check
def _unscale(xp, grads, inv):
    """(fp32 gradients g·inv of the low-precision ``grads``, None kept; does any hold inf/NaN?)"""
    out = [None if g is None else g.astype(np.float32) * inv for g in grads]
    present = [m for m in out if m is not None]
    return out, (_nonfinite(xp, present) if present else xp.asarray(False))


def found_inf_across(found: bool, groups=()) -> bool:
    """The OR of ``found`` over every rank of every group: an all-reduce max of a 0/1 flag per group.

    Pass every group a rank belongs to (DP, TP, PP); the flag travels group by group, so after the
    last one every rank of the whole mesh agrees."""
    flag = np.array([1.0 if found else 0.0], dtype=np.float32)
    for comm in groups:
        if comm is not None and comm.size > 1:
            flag = all_reduce(comm, flag, op="max")
    return bool(flag[0] > 0)


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
        shares the parameters -- the data-parallel group a DDP recorded on the model, the
        tensor-parallel groups of its layers, and the groups ``all_reduce_grads`` used (the same
        list on every rank: found in the same model order)."""
        if self.groups is not None:
            return self.groups
        found = {}
        for comm in claimed(self.model).values():
            if comm is not None:
                found.setdefault(id(comm), comm)
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
