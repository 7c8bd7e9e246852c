"""FP8 scaling: which number a tensor is divided by before it is rounded to 8 bits.

e4m3 spans 2^-9 .. 448, about 18 binades; a tensor's values must be moved into that window. A
**scale** s maps x to ``Q(x / s)`` and back to ``Q(x / s) · s``. Here every scale is a power of two,
the smallest with ``amax / s <= max`` (amax = the largest |x| the scale must cover), so dividing and
multiplying by it is exact: all the error is the rounding to FP8 itself. (Transformer Engine's
``power_2_scale`` and the MX formats' E8M0 scales make the same choice; a non-power-of-two scale
would use up to one more bit of range.)

The three recipes differ only in *which* amax, and *how many* scales:

* **current** (per tensor): amax of this tensor now -- one extra pass over it before the cast.
* **delayed** (per tensor): the max of an ``AmaxHistory`` of the last N steps' amaxes, the current one
  recorded afterwards (Transformer Engine's default): no extra pass, but a value larger than any in
  the window *saturates* to ±max·s, and one outlier then sets the scale for N steps.
* **block**: one scale per tile -- 1 x 128 for activations and gradients (per row, 128 features),
  128 x 128 for weights (DeepSeek-V3): an outlier costs only its own tile its small values.
"""

from __future__ import annotations

import math

import numpy as np

from minidist.accel.backend import backend_of, to_host
from minidist.parallel.memory.fp8_formats import get_format, round_to_format


def pow2_scale(amax: float, fmt, margin: int = 0) -> float:
    """The smallest power of two s with ``amax / s <= fmt.max``, times ``2^margin``; 1.0 when amax
    is 0 or not finite (nothing to cover; a NaN gradient is the loss scaler's business)."""
    amax = float(amax)
    if not math.isfinite(amax) or amax <= 0:
        return 2.0 ** margin
    m, e = math.frexp(amax / get_format(fmt).max)  # amax / max = m · 2^e, m in [0.5, 1)
    return 2.0 ** ((e - 1 if m == 0.5 else e) + margin)


def amax_of(x) -> float:
    """max |x| as a host float (one value read back)."""
    if not x.size:
        return 0.0
    xp = backend_of(x).xp
    return float(to_host(xp.max(xp.abs(x))))


def quantize_scaled(x, fmt, scale: float):
    """``Q(x / s) · s``: x rounded to ``fmt`` under scale s, saturating (fp32 values)."""
    s = x.dtype.type(scale) if x.dtype == np.float64 else np.float32(scale)
    return round_to_format(x / s, fmt) * s


class AmaxHistory:
    """The last ``length`` amaxes of one tensor: delayed scaling's memory.

    ``scale(fmt)`` uses the max over the window (or, on the first step with an empty window, the
    amax it is given); ``record(amax)`` appends this step's amax after the cast, dropping the oldest."""

    def __init__(self, length: int = 16):
        if not isinstance(length, int) or length < 1:
            raise ValueError(f"AmaxHistory length={length!r} must be an integer >= 1")
        self.length, self.values = length, []

    def amax(self, first: float) -> float:
        return max(self.values) if self.values else first

    def scale(self, fmt, first: float, margin: int = 0) -> float:
        return pow2_scale(self.amax(first), fmt, margin)

    def record(self, amax: float) -> None:
        """Keep this step's amax, unless it is inf or NaN (it would set the scale for ``length`` steps)."""
        if math.isfinite(amax):
            self.values.append(float(amax))
            del self.values[:-self.length]

    def state_dict(self) -> dict:
        return {"length": self.length, "values": list(self.values)}


def block_scales(x, fmt, block: tuple[int, int], margin: int = 0):
    """One power-of-two scale per ``block`` tile of the 2-D ``x`` (ragged edge tiles allowed): an
    array of shape (ceil(rows / br), ceil(cols / bc)), the same rule as ``pow2_scale`` per tile; a
    tile holding inf or NaN gets that as its scale (its values come out NaN: nothing saturates)."""
    xp = backend_of(x).xp
    tiles, _ = _tiles(xp, xp.abs(x), block)
    amax = tiles.max(axis=(1, 3))
    with np.errstate(divide="ignore"):
        m, e = xp.frexp(amax / amax.dtype.type(get_format(fmt).max))
    s = xp.ldexp(xp.ones_like(amax), xp.where(m == 0.5, e - 1, e) + margin)
    return xp.where(xp.isfinite(amax), xp.where(amax > 0, s, xp.ones_like(s)), amax)  # inf/NaN: itself


def block_quantize(x, fmt, block: tuple[int, int], margin: int = 0):
    """(``Q(x / s) · s`` with one scale per tile of the 2-D ``x``, the scales): block-wise FP8."""
    xp = backend_of(x).xp
    scales = block_scales(x, fmt, block, margin)
    tiles, pad = _tiles(xp, x, block)
    s = scales[:, None, :, None]
    with np.errstate(invalid="ignore"):  # a tile holding inf or NaN comes out NaN, by design
        q = (round_to_format(tiles / s, fmt) * s).reshape(tiles.shape[0] * tiles.shape[1], -1)
    return q[:x.shape[0], :x.shape[1]] if pad else q, scales


def expand_scales(scales, block: tuple[int, int], shape) -> np.ndarray:
    """The per-tile scales as a full array of ``shape`` (each element its tile's scale)."""
    xp = backend_of(scales).xp
    full = xp.repeat(xp.repeat(scales, block[0], axis=0), block[1], axis=1)
    return full[:shape[0], :shape[1]]


def _tiles(xp, x, block):
    """``x`` (rows, cols) zero-padded to whole tiles and viewed as (R, br, C, bc); padded or not."""
    br, bc = block
    rows, cols = x.shape
    pr, pc = -rows % br, -cols % bc
    if pr or pc:
        x = xp.pad(x, ((0, pr), (0, pc)))
    return x.reshape((rows + pr) // br, br, (cols + pc) // bc, bc), bool(pr or pc)
