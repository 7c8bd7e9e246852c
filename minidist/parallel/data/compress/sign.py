"""1-bit (sign) compression with error feedback (Seide et al. 2014; Karimireddy et al. 2019, EF-signSGD).

    m = g + residual;  scale = mean |m|;  sent = scale · sign(m);  residual = m - sent

One bit per entry (``np.packbits``) and one scale per bucket (the gradient's dtype) -- 32x fewer
bytes than fp32. sign is biased; the residual feeds the error back so it averages out. Every rank
all-gathers every rank's bits and scale and adds the decoded vectors in rank order.
Bytes per rank: (p-1)·(ceil(n/8) + itemsize).
"""

from __future__ import annotations

import numpy as np

from minidist.comm import all_gather


def sign_compress(m):
    """(message, sent): the packed signs (1 = m >= 0) and the scale's bytes; the decoded vector."""
    scale = np.abs(m).mean().astype(m.dtype)
    positive = (m >= 0).view(np.uint8)
    sent = np.array([-scale, scale], m.dtype)[positive]
    return np.concatenate([np.packbits(positive), np.atleast_1d(scale).view(np.uint8)]), sent


def sign_decompress(msg, n: int, dtype):
    dtype = np.dtype(dtype)
    scale = msg[-dtype.itemsize:].view(dtype)[0]
    return np.array([-scale, scale], dtype)[np.unpackbits(msg[:-dtype.itemsize], count=n)]


class SignState:
    """``error_feedback``: keep the residual per bucket (without it sign SGD may not converge)."""

    def __init__(self, error_feedback=True):
        self.error_feedback, self.residuals = error_feedback, {}


def sign_hook(state: SignState, bucket):
    """Sign + scale with error feedback: all-gather the bits, decode and add in rank order."""
    def work(c, x):
        res = state.residuals.get(bucket.index)
        m = x if res is None else x + res
        msg, sent = sign_compress(m)
        if state.error_feedback:
            state.residuals[bucket.index] = m - sent
        every = all_gather(c, msg, sizes="equal").reshape(c.size, msg.size)
        out = np.zeros_like(x)
        for r in range(c.size):
            out += sign_decompress(every[r], x.size, x.dtype)
        return out
    return bucket.start(work, bucket.flat, f"sign b{bucket.index}")
