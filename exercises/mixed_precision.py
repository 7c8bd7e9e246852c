"""Exercise 7: the dynamic loss scaler of mixed-precision training, with an inf flag all ranks agree on.

In fp16 small gradients underflow to 0, so the loss is multiplied by a scale S before backward and
the gradients divided by S before the step. Too large an S overflows: some gradient is inf or NaN,
and that step must be skipped -- on EVERY rank, or the replicas' parameters drift apart.

Estimated time: 45 min (scaler 15 min, agreed flag 10 min, the step 20 min)
Points: scaler_update 2, found_inf_across 2, scaled_sgd_step 3.
Grade it:  python -m minidist.grade mixed_precision
The grader replays random overflow sequences against the rules below, and runs the flag and the
step on 1..4 thread ranks with an inf or NaN planted on one rank. Lesson: lessons/07-mixed-precision.md;
minidist's answer is DynamicLossScaler and found_inf_across in minidist/parallel/memory/precision.py.
"""

import numpy as np  # noqa: F401  (you will need it)

from minidist.comm import all_reduce  # noqa: F401  (you will need it)


def scaler_update(state, found_inf, growth_interval=2000, growth_factor=2.0, backoff_factor=0.5,
                  min_scale=1.0):
    """The scaler's state after one step: a NEW dict {"scale", "clean_steps", "skipped"}.

    * found_inf: scale = max(scale * backoff_factor, min_scale), clean_steps = 0, skipped += 1.
    * otherwise: clean_steps += 1; when it reaches growth_interval, scale *= growth_factor and
      clean_steps = 0 (so with growth_interval=2 the scale doubles every second clean step).
    Do not modify ``state``.
    """
    raise NotImplementedError


def found_inf_across(comm, grads):
    """True on every rank if ANY rank's gradients (a list of NumPy arrays) hold an inf or a NaN.

    One all-reduce of a 0/1 flag (``all_reduce(comm, flag, op="max")``): every rank must return
    the same answer, or one replica steps while another skips.
    Does not modify its inputs.
    """
    raise NotImplementedError


def scaled_sgd_step(comm, params, scaled_grads, state, lr, growth_interval=2000):
    """One mixed-precision SGD step: returns (new params, new scaler state).

    ``scaled_grads`` are the gradients of S * loss (S = state["scale"]), already averaged over the
    ranks. Unscale them (divide by S); if ``found_inf_across`` says any rank overflowed, skip the
    step (return the params unchanged) on every rank; else p - lr * g. Then update the scaler with
    ``scaler_update(state, found, growth_interval)``. Do not modify the input arrays.
    """
    raise NotImplementedError
