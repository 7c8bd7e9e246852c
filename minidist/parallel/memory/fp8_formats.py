"""The two FP8 formats, and rounding to them written out as arithmetic that runs on any backend.

An FP8 number is 1 sign bit, E exponent bits and M mantissa bits (Micikevicius et al. 2022, "FP8
Formats for Deep Learning"); its value is ``(-1)^s · 2^(e - bias) · (1 + m/2^M)`` for a normal
exponent field ``e > 0`` and ``(-1)^s · 2^(1 - bias) · (m/2^M)`` for ``e == 0`` (subnormals):

    format   E  M  bias  max      min normal  min subnormal  inf  NaN
    e4m3fn   4  3   7    448      2^-6        2^-9           no   S.1111.111 only
    e5m2     5  2  15    57344    2^-14       2^-16          yes  as IEEE (exponent 11111)

e4m3 ("fn": finite, NaN-only) gives up inf and all but one NaN to gain one more binade: forward
passes (activations, weights) want its precision. e5m2 keeps IEEE's inf/NaN and 8 more binades of
range: gradients want the range. ``ml_dtypes`` provides both as NumPy dtypes; this file rounds to
them by arithmetic (``frexp`` for the exponent, ``rint`` -- round half to even -- on the scaled
significand) so the same code runs on NumPy, CuPy and JAX arrays; the tests check it against
``ml_dtypes``' own casts on every representable value and on every midpoint between two of them.

Training saturates: a finite value beyond ``max`` becomes ``±max`` (Transformer Engine's cast); inf
and NaN stay what they are, so an overflow upstream shows in the product. A plain cast
(``saturate=False``, ml_dtypes' behaviour) overflows to NaN in e4m3fn and to inf in e5m2.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from minidist.accel.backend import backend_of


@dataclass(frozen=True)
class Format:
    """One FP8 format: its bit layout and the ``ml_dtypes`` dtype that stores it."""

    name: str
    exp_bits: int
    man_bits: int
    bias: int
    max: float
    has_inf: bool
    dtype: np.dtype

    @property
    def emin(self) -> int:
        """The exponent of the smallest normal number (subnormals share it): 1 - bias."""
        return 1 - self.bias

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.emin - self.man_bits)


E4M3 = Format("e4m3", 4, 3, 7, 448.0, False, np.dtype(ml_dtypes.float8_e4m3fn))
E5M2 = Format("e5m2", 5, 2, 15, 57344.0, True, np.dtype(ml_dtypes.float8_e5m2))
FORMATS = {"e4m3": E4M3, "e4m3fn": E4M3, "e5m2": E5M2}


def get_format(fmt) -> Format:
    """"e4m3" | "e5m2" (or a Format) -> the Format, with a clear error otherwise."""
    if isinstance(fmt, Format):
        return fmt
    if fmt not in FORMATS:
        raise ValueError(f"unknown FP8 format {fmt!r}; use 'e4m3' (forward) or 'e5m2' (gradients)")
    return FORMATS[fmt]


def _work_dtype(x):
    """fp64 stays fp64 (a reference computation); everything else is rounded in fp32."""
    return np.float64 if x.dtype == np.float64 else np.float32


def round_mantissa(x, man_bits: int, emin: int | None = None):
    """``x`` rounded to nearest-even with ``man_bits`` bits after the leading one; with ``emin``,
    numbers below ``2^emin`` keep the spacing ``2^(emin - man_bits)`` (subnormals). No range limit
    above: the caller saturates. Exact arithmetic: ``frexp`` and multiplying by powers of two."""
    xp = backend_of(x).xp
    x = x.astype(_work_dtype(x), copy=False)
    _, e = xp.frexp(x)  # |x| = f · 2^e with f in [0.5, 1): the leading bit is 2^(e - 1)
    if emin is not None:
        e = xp.maximum(e, emin + 1)
    ulp = xp.ldexp(xp.ones_like(x), e - 1 - man_bits)
    with np.errstate(invalid="ignore", over="ignore"):  # inf / inf: NaN, put back below
        q = xp.rint(x / ulp) * ulp
    return xp.where(xp.isinf(x), x, q)


def round_to_format(x, fmt, saturate: bool = True):
    """``x`` rounded to the nearest value of ``fmt`` (ties to even), returned as fp32 (fp64 for
    fp64 input) holding exactly that value. ``saturate``: finite beyond ±max -> ±max, as training
    casts do (inf and NaN kept); otherwise overflow is NaN (e4m3fn) or ±inf (e5m2), as ml_dtypes casts."""
    f = get_format(fmt)
    xp = backend_of(x).xp
    q = round_mantissa(x, f.man_bits, f.emin)
    over = xp.abs(q) > f.max
    if saturate:
        return xp.where(over & xp.isfinite(q), xp.sign(q) * f.max, q).astype(q.dtype)
    overflow = xp.where(q < 0, -np.inf, np.inf) if f.has_inf else np.nan
    return xp.where(over, overflow, q).astype(q.dtype)


def to_bits(q, fmt) -> np.ndarray:
    """Values already on ``fmt``'s grid (NumPy) -> their one-byte codes (uint8): what is stored and sent."""
    return np.asarray(q).astype(get_format(fmt).dtype).view(np.uint8)


def from_bits(codes, fmt, dtype=np.float32) -> np.ndarray:
    """uint8 codes -> their values in ``dtype`` (the decode: exact, FP8 values fit any float)."""
    return np.asarray(codes, dtype=np.uint8).view(get_format(fmt).dtype).astype(dtype)
