"""FP8 training: every Linear's three products with FP8 inputs, accumulated in fp32.

    model = fp8_linear(GPT(cfg), "block")     # or "current", "delayed", or an Fp8Recipe
    opt = AdamW(model.parameters(), lr=...)    # the fp32 parameters are the master weights

The recipe of Transformer Engine and DeepSeek-V3, emulated (a CPU has no FP8 tensor core, but the
numbers are the same). Per Linear ``y = x W + b``: forward ``y = Q4(x) Q4(W) + b``, backward
``dx = Q5(dy) Q4(W)^T`` and ``dW = Q4(x)^T Q5(dy)``, where Q4 rounds to e4m3 and Q5 to e5m2 under
a scale from the recipe (``fp8_scaling``: current, delayed or block; block tiles each operand along
the dimension its GEMM sums over: dW's x and dy in 128 x 1, x re-quantized from its stored 1 x 128
FP8 as DeepSeek-V3 does). Products of FP8 numbers are exact in fp32: the only roundings are the
casts and the accumulation. The parameters stay fp32: FP8 is a property of the products.

``fp8_linear`` wraps every Linear-like layer -- a Module whose ``forward(x, product=None)`` takes
its GEMM as an argument (``nn.Linear`` and the tensor-parallel Column/RowParallelLinear) -- at the
innermost ("autocast") position of ``Module``'s wrapper stack and hands it ``Fp8Linear`` as the
product; a layer with a group (``comm``) max-reduces its amaxes over it, so a sharded model equals
the serial FP8 model. The LM head stays fp32 unless ``include_head``. Chapter 7
(lessons/07-mixed-precision.md) has the formats, the recipes and the error bound.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import numpy as np

from minidist.autograd.tensor import Function
from minidist.comm import all_reduce
from minidist.nn.module import Module
from minidist.parallel.memory.fp8_formats import E4M3, E5M2, round_mantissa
from minidist.parallel.memory.fp8_scaling import (
    AmaxHistory,
    amax_of,
    block_quantize,
    pow2_scale,
    quantize_scaled,
)

SCALINGS = ("current", "delayed", "block")
OWNER = "fp8_linear"  # the owner of fp8_linear's forward wrappers: how they are found again


ROLES = {"x": "input activations", "w": "weights", "g": "output gradients", "xt": "input activations",
         "gt": "output gradients"}


class Fp8Overflow(FloatingPointError):
    """An inf or NaN met by an FP8 layer whose recipe says ``on_overflow="raise"``."""


@dataclass(frozen=True)
class Fp8Recipe:
    """How a Linear's operands are scaled. ``scaling``: "current" | "delayed" | "block";
    ``history``: the delayed amax window (steps); ``block``: tile side (1 x block activations and
    gradients, block x block weights); ``accumulate``: None (fp32) or (N, mantissa bits);
    ``margin``: scales times 2^margin (headroom, for delayed scaling); ``on_overflow``: a non-finite
    amax "skip"s the step (``fp8_step``) or "raise"s ``Fp8Overflow`` at once."""

    scaling: str = "block"
    history: int = 16
    block: int = 128
    accumulate: tuple | None = None
    margin: int = 0
    on_overflow: str = "skip"

    def __post_init__(self):
        if self.scaling not in SCALINGS:
            raise ValueError(f"Fp8Recipe scaling={self.scaling!r}; use one of {', '.join(SCALINGS)}")
        if self.on_overflow not in ("skip", "raise"):
            raise ValueError(f"Fp8Recipe on_overflow={self.on_overflow!r}; use 'skip' or 'raise'")
        if not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"Fp8Recipe block={self.block!r} must be a positive integer (128: DeepSeek-V3)")
        if not isinstance(self.history, int) or self.history < 1:
            raise ValueError(f"Fp8Recipe history={self.history!r} must be a positive integer (steps)")
        acc = self.accumulate
        if acc is not None and (len(acc) != 2 or not all(isinstance(v, int) and v >= 1 for v in acc)):
            raise ValueError(f"Fp8Recipe accumulate={acc!r} must be None or (N, mantissa bits), both "
                             "positive integers, e.g. (128, 13)")


def get_recipe(recipe) -> Fp8Recipe:
    """An Fp8Recipe, or the name of a scaling ("current" | "delayed" | "block") with defaults."""
    if isinstance(recipe, Fp8Recipe):
        return recipe
    if isinstance(recipe, str):
        return Fp8Recipe(scaling=recipe)
    raise ValueError(f"fp8 recipe={recipe!r}; use an Fp8Recipe or one of {', '.join(SCALINGS)}")


class Fp8Quantizer:
    """One layer's scaling state: its recipe, an ``AmaxHistory`` per operand ("x", "w", "g"), the
    scales it used last (``last``: role -> a float, or the per-tile array for block scaling) and the
    operands whose amax was inf or NaN since ``fp8_step`` last looked (``nonfinite``)."""

    def __init__(self, recipe, name: str = ""):
        self.recipe, self.name = get_recipe(recipe), name
        self.history = {r: AmaxHistory(self.recipe.history) for r in ("x", "w", "g")}
        self.last: dict = {}
        self.nonfinite: list = []

    def check(self, role: str, amax) -> None:
        """A non-finite amax (or tile scale): noted for ``fp8_step``, or ``Fp8Overflow`` at once."""
        if not np.isfinite(amax).all():
            self.nonfinite.append(role)
            if self.recipe.on_overflow == "raise":
                raise Fp8Overflow(f"FP8 layer {self.name or '(model)'}: its {ROLES[role]} hold inf or NaN "
                                  "(a non-finite amax); no scale can round them. Fix the overflow, or let "
                                  "Fp8Recipe(on_overflow='skip') skip such a step")

    def quantize(self, role: str, a, fmt, amax: float | None, update: bool = True):
        """``a`` (2-D) on ``fmt``'s grid under this recipe's scale(s) for ``role``; ``amax``: the
        tensor's (group-reduced) amax for the per-tensor recipes."""
        r = self.recipe
        if r.scaling == "block":  # tiles along the dimension the GEMM reduces over (module docstring)
            tile = {"w": (r.block, r.block), "xt": (r.block, 1), "gt": (r.block, 1)}.get(role, (1, r.block))
            q, self.last[role] = block_quantize(a, fmt, tile, r.margin)
            self.check(role, self.last[role])  # a tile holding inf or NaN has that as its scale
            return q
        self.check(role, amax)
        if r.scaling == "current":
            scale = pow2_scale(amax, fmt, r.margin)
        else:
            scale = self.history[role].scale(fmt, amax, r.margin)
            if update:
                self.history[role].record(amax)
        self.last[role] = scale
        return quantize_scaled(a, fmt, scale)

    def amaxes(self, arrays, group):
        """Each array's amax (None for block scaling), max-reduced over ``group``: one all-reduce."""
        if self.recipe.scaling == "block":
            return [None] * len(arrays)
        local = np.array([amax_of(a) for a in arrays], dtype=np.float64)
        if group is not None and group.size > 1:
            local = all_reduce(group, local, op="max")
        return [float(v) for v in local]


def fp8_matmul(a, b, accumulate=None):
    """``a @ b`` of FP8-valued operands: fp32 accumulation, or partial sums of ``N`` products rounded
    to ``bits`` mantissa bits and promoted into an fp32 total (``accumulate=(N, bits)``)."""
    if accumulate is None:
        return a @ b
    n, bits = accumulate
    out = None
    for k in range(0, a.shape[1], n):
        part = round_mantissa(a[:, k:k + n] @ b[k:k + n], bits)
        out = part if out is None else out + part
    return out


class Fp8Linear(Function):
    """``x @ w + b`` with FP8 operands (module docstring). ``quant``: the layer's ``Fp8Quantizer``;
    ``group``: where per-tensor amaxes are max-reduced (the layer's tensor-parallel group, or None);
    ``update``: record the delayed amaxes (training mode)."""

    @staticmethod
    def forward(ctx, x, w, b=None, quant=None, group=None, update=True):
        if x.shape[-1] != w.shape[0]:
            raise ValueError(f"Fp8Linear: x of shape {tuple(x.shape)} and weight {tuple(w.shape)} don't "
                             f"match: x's last axis must be the weight's in_features {w.shape[0]}")
        if x.dtype != np.float32 or w.dtype != np.float32:
            raise ValueError(f"Fp8Linear: x ({x.dtype}) and weight ({w.dtype}) must be float32 "
                             "(the fp32 master weights; FP8 is applied inside)")
        rows = x.reshape(-1, x.shape[-1])
        ax, aw = quant.amaxes([rows, w], group)
        qx = quant.quantize("x", rows, E4M3, ax, update)
        qw = quant.quantize("w", w, E4M3, aw, update)
        ctx.save(qx if ctx.needs_grad[1] else None, qw if ctx.needs_grad[0] else None)
        ctx.quant, ctx.group, ctx.update, ctx.shape = quant, group, update, x.shape
        y = fp8_matmul(qx, qw, quant.recipe.accumulate)
        if b is not None:
            y = y + b
        return y.reshape(x.shape[:-1] + (w.shape[1],))

    @staticmethod
    def backward(ctx, g):
        qx, qw = ctx.saved
        quant, acc = ctx.quant, ctx.quant.recipe.accumulate
        g2 = g.reshape(-1, g.shape[-1]).astype(np.float32, copy=False)
        (ag,) = quant.amaxes([g2], ctx.group)
        qg = quant.quantize("g", g2, E5M2, ag, ctx.update)
        gx = fp8_matmul(qg, qw.T, acc).reshape(ctx.shape) if ctx.needs_grad[0] else None
        if ctx.needs_grad[1] and quant.recipe.scaling == "block":  # dW = x^T g sums over the tokens:
            qx, qg = quant.quantize("xt", qx, E4M3, None), quant.quantize("gt", g2, E5M2, None)  # 128 x 1
        gw = fp8_matmul(qx.T, qg, acc) if ctx.needs_grad[1] else None
        gb = g2.sum(axis=0) if len(ctx.needs_grad) > 2 and ctx.needs_grad[2] else None
        return gx, gw, gb


class Fp8Forward:
    """The forward wrapper ``fp8_linear`` registers on one layer: the layer's own forward (and its
    communication, if any) with ``Fp8Linear`` as its product; ``quant`` holds its scaling state."""

    def __init__(self, recipe, name: str = ""):
        self.quant = Fp8Quantizer(recipe, name)

    def __call__(self, module, inner, x):
        group = getattr(module, "comm", None)  # a tensor-parallel layer's group: amaxes max-reduced there

        def product(x, w, b=None):
            args = (x, w) if b is None else (x, w, b)
            return Fp8Linear.apply(*args, quant=self.quant, group=group, update=module.training)
        return inner(x, product=product)


def is_linear_like(module) -> bool:
    """Does ``module`` take its GEMM as an argument, ``forward(x, product=None)``? (``nn.Linear``,
    ``ColumnParallelLinear``, ``RowParallelLinear``: recognised by that, so FP8 imports none of them.)"""
    return isinstance(module, Module) and "product" in inspect.signature(type(module).forward).parameters


def _head_members(model) -> set:
    """ids of the modules inside an LM head (a ``Head`` or ``ParallelHead``)."""
    out = set()
    for _, m in model.named_modules():
        if type(m).__name__ in ("Head", "ParallelHead"):
            out.update(id(sub) for _, sub in m.named_modules())
    return out


def check_fp8(model) -> None:
    """Raise a ValueError unless ``model`` is a Module. (Which techniques FP8 joins, and in which
    order, is ``parallelize``'s table.)"""
    if not hasattr(model, "named_modules"):
        raise ValueError(f"fp8_linear needs a Module (a GPT, a TPGPT), not a {type(model).__name__}")


def fp8_linear(model, recipe="block", include_head: bool = False):
    """Make every Linear of ``model`` (serial or tensor-parallel) compute its products in FP8 under
    ``recipe``; returns the model. Apply it to the fp32 model after building tensor parallelism and
    before DDP. ``remove_fp8`` undoes it; ``fp8_quantizers`` lists each layer's scaling state."""
    rec = get_recipe(recipe)
    check_fp8(model)
    head = set() if include_head else _head_members(model)
    for name, m in model.named_modules():
        if is_linear_like(m) and id(m) not in head:
            m.register_forward_wrapper(Fp8Forward(rec, name.rstrip(".")), "autocast", OWNER)
    return model


def fp8_quantizers(model) -> dict:
    """layer name -> its ``Fp8Quantizer`` (the amax histories and last scales), in model order."""
    out = {}
    for name, m in model.named_modules():
        h = m.forward_wrapper("autocast")
        if h is not None and h.owner == OWNER:
            out[name.rstrip(".")] = h.fn.quant
    return out


def remove_fp8(model):
    """Take ``fp8_linear``'s wrappers away: the Linears compute in fp32 again."""
    for _, m in model.named_modules():
        h = m.forward_wrapper("autocast")
        if h is not None and h.owner == OWNER:
            h.remove()
    return model
