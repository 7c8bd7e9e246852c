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
   of the flag over every group (data, tensor, pipeline parallel) before any rank steps; a rank
   that stepped while another skipped would silently diverge.

bf16 is ``ml_dtypes.bfloat16``; ``round_to_bf16`` writes its round-to-nearest-even out by hand.
"""

from __future__ import annotations

import types

import ml_dtypes
import numpy as np

from minidist import ops
from minidist.backend import backend_of
from minidist.comm import all_reduce
from minidist.nn.layers import LayerNorm, Linear
from minidist.tensor import Tensor, no_grad

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
def _linear_forward(lin, x, out_f32=False):
    """Low-precision x and weight, product accumulated in fp32, output rounded to low precision."""
    f32 = np.float32
    b = None if lin.bias is None else ops.cast(lin.bias, f32)
    y = ops.linear(ops.cast(x, f32), ops.cast(lin.weight, f32), b)
    low = lin.weight.dtype
    y = ops.cast(y, low)
    return ops.cast(y, f32) if out_f32 else y


def _layer_norm_forward(ln, x):
    f32 = np.float32
    y = ops.layer_norm(ops.cast(x, f32), ops.cast(ln.weight, f32), ops.cast(ln.bias, f32), ln.eps)
    return ops.cast(y, ln.weight.dtype)


def _row_parallel_local(lin, x):
    """``RowParallelLinear``'s partial product in low precision: accumulated in fp32 and rounded, so
    the reduction over the group moves low-precision values (half the bytes of fp32, as Megatron)."""
    f32 = np.float32
    return ops.cast(ops.linear(ops.cast(x, f32), ops.cast(lin.weight, f32)), lin.weight.dtype)


def _row_parallel_add_bias(lin, y):
    """The bias added in fp32 after the reduction, the sum rounded again."""
    f32 = np.float32
    return ops.cast(ops.cast(y, f32) + ops.cast(lin.bias, f32), lin.weight.dtype)


def _fp32_copy(a):
    """An fp32 copy of ``a`` on ``a``'s own backend (the masters live where the model does)."""
    be = backend_of(a)
    return be.from_host(np.array(be.to_host(a), dtype=np.float32))


def autocast(model, dtype="bf16"):
    """Make ``model`` compute in ``dtype``: its parameters are cast (in place) and its Linear and
    LayerNorm layers -- and the tensor-parallel ``ColumnParallelLinear`` / ``RowParallelLinear`` --
    run as above. The attention's qkv projection hands the attention core low-precision *values*
    held in fp32, so the softmax runs in fp32 (as torch.autocast does). Returns the model. Cast the
    logits to fp32 before the loss (``MixedPrecision.loss`` does)."""
    from minidist.parallel.tp_layers import ColumnParallelLinear, RowParallelLinear

    dt = low_dtype(dtype)
    for p in model.parameters():
        p.data = p.data.astype(dt)
    for name, m in model.named_modules():
        qkv = name.endswith("attn.qkv")
        if isinstance(m, Linear):
            hooks = {"forward": lambda lin, x, q=qkv: _linear_forward(lin, x, out_f32=q)}
        elif isinstance(m, ColumnParallelLinear):  # its communication stays; only the local product changes
            hooks = {"_local": lambda lin, x, q=qkv: _linear_forward(lin, x, out_f32=q)}
        elif isinstance(m, RowParallelLinear):
            hooks = {"_local": _row_parallel_local, "_add_bias": _row_parallel_add_bias}
        elif isinstance(m, LayerNorm):
            hooks = {"forward": _layer_norm_forward}
        else:
            continue
        for attr, fn in hooks.items():
            object.__setattr__(m, attr, types.MethodType(fn, m))
    return model  # (an Embedding needs nothing: rows of a low-precision table are low precision)


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
    """Is any element of any array inf or NaN?"""
    return any(a is not None and not bool(backend_of(a).xp.isfinite(a).all()) for a in arrays)


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
    slice of the logits), else ``ops.cross_entropy`` of full logits. For a tensor-parallel model
    pass its TP group in ``groups`` too, so its ranks skip together.
    """

    def __init__(self, model, dtype="bf16", scaler="auto", groups=(), loss_fn=None):
        self.dtype = low_dtype(dtype)
        if scaler == "auto":
            scaler = DynamicLossScaler() if self.dtype == np.float16 else None
        self.scaler, self.groups = scaler, list(groups)
        self.master_params = [Tensor(_fp32_copy(p.data), requires_grad=True, name=n)  # same device as p
                              for n, p in model.named_parameters()]
        self.model = autocast(model, self.dtype)
        self.params = model.parameters()
        self.last_found_inf = False
        self.loss_fn = loss_fn or getattr(model, "loss_fn", None) or ops.cross_entropy

    @property
    def scale(self) -> float:
        return 1.0 if self.scaler is None else self.scaler.scale

    def loss(self, idx, targets):
        """``loss_fn`` (cross-entropy) in fp32 of the low-precision model's logits."""
        return self.loss_fn(ops.cast(self.model(idx), np.float32), targets)

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
        from minidist.parallel.ddp import build_buckets

        for b in build_buckets([p for p in self.params if p.grad is not None], float("inf")):
            flat = b.flatten([p.grad for p in b.params])
            flat = all_reduce(comm, flat * np.asarray(1.0 / comm.size, dtype=flat.dtype), op="sum")
            for p, v in zip(b.params, b.views(flat)):
                p.grad = v

    def step(self, optimizer) -> bool:
        """Unscale into the fp32 masters, agree on inf/NaN across ``groups``, step or skip; True if
        stepped. Low-precision grads are cleared; the model gets the new masters, rounded."""
        inv = 1.0 / self.scale
        for m, p in zip(self.master_params, self.params):
            m.grad = None if p.grad is None else p.grad.astype(np.float32) * np.float32(inv)
            p.grad = None
        found = found_inf_across(has_inf_or_nan(m.grad for m in self.master_params), self.groups)
        self.last_found_inf = found
        if self.scaler is not None:
            self.scaler.update(found)
        if not found:
            optimizer.step()
            with no_grad():
                for m, p in zip(self.master_params, self.params):
                    p.data = m.data.astype(self.dtype)
        for m in self.master_params:
            m.grad = None
        return not found
