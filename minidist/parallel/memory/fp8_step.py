"""``fp8_step``: the optimizer step of an FP8 model, skipped when an FP8 layer met an inf or NaN.

An FP8 layer (``fp8.Fp8Quantizer``) notes every operand whose amax is not finite: it never keeps such
an amax in its delayed-scaling history, and rounding keeps inf and NaN (nothing saturates them away),
so the overflow reaches the gradients. A step with such a note is skipped on every rank, as a loss
scaler skips one (``found_inf_across``), with a warning naming the layers; a recipe with
``on_overflow="raise"`` raises ``Fp8Overflow`` at the layer instead. Chapter 7 says why.
"""

from __future__ import annotations

import warnings

from minidist.parallel.memory.fp8 import ROLES, fp8_quantizers
from minidist.parallel.memory.loss_scale import found_inf_across


def fp8_step(model, optimizer, groups=()) -> bool:
    """``optimizer.step()`` unless an FP8 layer met an inf or NaN since the last call (agreed over
    ``groups``, as a loss scaler's skip is): then a warning naming the layers, the gradients zeroed,
    False. Inf is never saturated away (``round_to_format``) nor kept in an amax history."""
    bad = [f"{q.name or '(model)'} ({ROLES[r]})" for q in fp8_quantizers(model).values() for r in q.nonfinite]
    for q in fp8_quantizers(model).values():
        q.nonfinite = []
    if found_inf_across(bool(bad), groups):
        names = list(dict.fromkeys(bad))
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        where = ", ".join(names[:3]) + more if names else "another rank"
        warnings.warn(f"FP8: step skipped, a non-finite amax in {where}", RuntimeWarning, stacklevel=2)
        optimizer.zero_grad()
        return False
    optimizer.step()
    return True

