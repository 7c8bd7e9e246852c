"""Exercise 7b: FP8 scaling -- power-of-two scales, block-wise quantization, the delayed amax history.

e4m3 (``ml_dtypes.float8_e4m3fn``) holds magnitudes from 2^-9 to 448. A tensor is divided by a scale s,
rounded to e4m3, and multiplied back: ``Q(x / s) · s``. Which s, and how many of them, is the recipe.

Estimated time: 40 min (scale 10 min, block-wise quantize 20 min, amax history 10 min)
Points: pow2_scale 2, block_quantize 3, delayed_scales 2.
Grade it:  python -m minidist.grade fp8
The grader checks every rule below on random tensors (ragged edge tiles included) and random amax
sequences. Lesson: lessons/07-mixed-precision.md (FP8); minidist's answer is pow2_scale,
block_quantize and AmaxHistory in minidist/parallel/memory/fp8_scaling.py.
"""

import ml_dtypes  # noqa: F401  (you will need it: ml_dtypes.float8_e4m3fn)
import numpy as np  # noqa: F401  (you will need it)

E4M3_MAX = 448.0


def pow2_scale(amax, fmax=E4M3_MAX):
    """The smallest power of two s with ``amax / s <= fmax`` (s may be below 1); 1.0 when amax is 0.

    A power of two makes ``x / s`` and ``q * s`` exact: the only error left is the rounding to FP8."""
    raise NotImplementedError


def block_quantize(x, block_rows, block_cols):
    """Block-wise e4m3 of the 2-D float32 array ``x``: returns (q, scales).

    Tiles of block_rows x block_cols from the top-left corner; the last tiles along each axis may
    be smaller (ragged edges). Each tile gets ``s = pow2_scale(max |tile|)``, and its entries become
    ``float32(e4m3(clip(x / s, -448, 448))) * s``. ``q`` has x's shape (float32); ``scales`` has shape
    (ceil(rows / block_rows), ceil(cols / block_cols)), scales[i, j] for tile (i, j).
    Does not modify its inputs."""
    raise NotImplementedError


def delayed_scales(amaxes, history):
    """The scale delayed scaling uses at each step, for a tensor whose amax at step t is amaxes[t].

    At step t the amax is not known before the cast: the scale comes from the max of the amaxes of
    the previous ``history`` steps (steps t-history .. t-1, as many as exist); step 0, with an empty
    window, uses its own amax. Each step's amax is recorded after its cast. Returns a list of
    ``pow2_scale`` values, one per step. Does not modify its inputs."""
    raise NotImplementedError
