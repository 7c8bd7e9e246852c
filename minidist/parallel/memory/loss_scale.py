"""fp16's dynamic loss scale, and the inf/NaN flag every rank must agree on before it steps.

``DynamicLossScaler`` starts at S = 2^16, halves S and skips the step when a gradient is inf/NaN,
and doubles S after ``growth_interval`` clean steps. ``has_inf_or_nan`` checks arrays in one pass;
``found_inf_across(flag, groups)`` takes the max of the flag over every group, so a skip is
unanimous (a rank that stepped while another skipped would silently diverge). Re-exported by
``minidist.parallel.memory.precision``.
"""

from __future__ import annotations

import numpy as np

from minidist.accel import compiled
from minidist.accel.backend import backend_of
from minidist.comm import all_reduce


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


@compiled.pure
def _nonfinite(xp, arrays):
    """A 0-d boolean array: does any of ``arrays`` hold an inf or NaN?"""
    return ~xp.stack([xp.isfinite(a).all() for a in arrays]).all()


@compiled.pure  # on JAX one compiled call per step: the casts, the multiplies and the check
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
