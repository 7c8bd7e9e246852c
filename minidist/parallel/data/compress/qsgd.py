"""QSGD (Alistarh et al. 2017): s levels, stochastic rounding, bit-packed, the norm alongside.

Each entry v_i becomes ``norm · sign_i · l_i / s`` with l_i in {0..s}: ``|v_i|/norm · s`` rounded
down or up at random, up with probability equal to the fraction -- so E[l_i] = |v_i|/norm · s and the
decoded vector is **unbiased** (no error feedback needed; the variance is at most (norm/s)²/4 per
entry). A code is ``b = 1 + ceil(log2(s+1))`` bits (sign, level): s = 7 is "4-bit QSGD".
``np.packbits`` packs n codes into ceil(n·b/8) bytes; the norm (the gradient's dtype) is appended.

Every rank all-gathers every rank's packed message and decodes them all, in rank order: the same
sum everywhere. Bytes per rank: (p-1)·(ceil(n·b/8) + itemsize).
"""

from __future__ import annotations

import math

import numpy as np

from minidist.comm import all_gather


def code_bits(s: int) -> int:
    """Bits per entry: one sign bit and enough for levels 0..s."""
    return 1 + math.ceil(math.log2(s + 1))


def qsgd_encode(v, s: int, rng) -> np.ndarray:
    """``v`` -> uint8 message: the packed (level, sign) codes, then the norm's bytes."""
    norm = np.linalg.norm(v).astype(v.dtype)
    scaled = np.abs(v) / norm * v.dtype.type(s) if norm > 0 else np.zeros_like(v)
    low = np.floor(scaled)
    level = (low + (rng.random(v.size, dtype=np.float32) < scaled - low)).astype(np.uint8)
    bits = code_bits(s)
    code = level | ((v < 0).astype(np.uint8) << (bits - 1))  # s < 128: a code fits a byte
    planes = np.empty((v.size, bits), np.uint8)  # bit i of every code, as a column
    for i in range(bits):
        np.bitwise_and(code >> i, 1, out=planes[:, i])
    return np.concatenate([np.packbits(planes.reshape(-1)), np.atleast_1d(norm).view(np.uint8)])


def qsgd_decode(msg: np.ndarray, n: int, s: int, dtype) -> np.ndarray:
    """The inverse of ``qsgd_encode`` (of n entries of ``dtype``): norm · sign · level / s."""
    dtype, bits = np.dtype(dtype), code_bits(s)
    norm = msg[-dtype.itemsize:].view(dtype)[0]
    planes = np.unpackbits(msg[:-dtype.itemsize], count=n * bits).reshape(n, bits)
    code = np.zeros(n, np.uint8)
    for i in range(bits):
        code |= planes[:, i] << i
    values = np.arange(s + 1, dtype=dtype) * (norm / dtype.type(s))  # level -> norm · level / s
    table = np.concatenate([values, np.zeros((1 << (bits - 1)) - s - 1, dtype), -values,
                            np.zeros((1 << (bits - 1)) - s - 1, dtype)])
    return table[code]


class QSGDState:
    """``levels``: s (7 = 4 bits per entry with the sign); ``seed``: the per-rank rounding generator."""

    def __init__(self, levels=7, seed=0):
        if not isinstance(levels, int) or not 1 <= levels <= 127:
            raise ValueError(f"QSGD levels={levels!r} must be an integer in 1..127 (a code fits a byte)")
        self.levels, self.seed, self.rng = levels, seed, None


def qsgd_hook(state: QSGDState, bucket):
    """QSGD: encode, all-gather the packed messages, decode and add them in rank order."""
    def work(c, x):
        if state.rng is None:
            state.rng = np.random.default_rng([state.seed, c.rank])
        msg = qsgd_encode(x, state.levels, state.rng)
        every = all_gather(c, msg, sizes="equal").reshape(c.size, msg.size)
        out = np.zeros_like(x)
        for r in range(c.size):
            out += qsgd_decode(every[r], x.size, state.levels, x.dtype)
        return out
    return bucket.start(work, bucket.flat, f"qsgd b{bucket.index}")
