"""FP8 all-reduce: gradients on the wire as 1-byte e4m3 codes with one fp32 scale per chunk.

A sum of FP8 numbers is not an FP8 number, so a ring that added in FP8 would round at every hop.
Instead (as torchft's quantized all-reduce does) the sum runs in two exchanges of FP8 codes with
fp32 arithmetic in between:

1. every rank scales its bucket by one power-of-two scale (``pow2_scale`` of its amax), rounds it to
   e4m3 and sends chunk j of the codes, with the scale's 4 bytes, to rank j (``all_to_all``);
2. rank j decodes the p chunks it received, adds them in fp32 in rank order, and quantizes its
   reduced chunk again under a new scale;
3. every rank all-gathers the reduced chunks (codes + scale) and decodes them.

Bytes sent per rank, chunks of c = n/p entries: (p-1)·(c + 4) in each exchange, 2·(p-1)·(n/p + 4)
in all: a quarter of fp32's 2·(p-1)/p·4n, plus 8 bytes per peer. Every rank decodes the same codes:
the result is identical on every rank. The scale is per bucket (per rank and chunk), so a bucket with
one huge gradient loses its small entries -- buckets are a layer or a few, as DDP builds them.
"""

from __future__ import annotations

import numpy as np

from minidist.comm import all_gather, all_to_all, split_sizes
from minidist.parallel.memory.fp8_formats import E4M3, from_bits, to_bits
from minidist.parallel.memory.fp8_scaling import amax_of, pow2_scale, quantize_scaled

SCALE_BYTES = 4


def encode(x) -> np.ndarray:
    """fp32 ``x`` -> uint8 message: e4m3 codes of x / s, then s as 4 bytes (s a power of two)."""
    x = np.asarray(x, dtype=np.float32)
    scale = pow2_scale(amax_of(x), E4M3)
    codes = to_bits(quantize_scaled(x, E4M3, scale) / np.float32(scale), E4M3)
    return np.concatenate([codes, np.array([scale], np.float32).view(np.uint8)])


def decode(msg) -> np.ndarray:
    """The inverse of ``encode``: fp32 values ``code · s``."""
    msg = np.asarray(msg, dtype=np.uint8)
    scale = msg[-SCALE_BYTES:].view(np.float32)[0]
    return from_bits(msg[:-SCALE_BYTES], E4M3) * scale


def fp8_all_reduce(comm, x) -> np.ndarray:
    """Σ over ranks of fp32 ``x`` with every message in FP8 (the module docstring's three steps)."""
    p = comm.size
    if p == 1:
        return decode(encode(x))
    sizes = split_sizes(x.size, p)
    bounds = np.cumsum([0] + sizes)
    flat = np.asarray(x, dtype=np.float32).reshape(-1)
    received = all_to_all(comm, [encode(flat[bounds[j]:bounds[j + 1]]) for j in range(p)])
    mine = np.zeros(sizes[comm.rank], np.float32)
    for msg in received:  # rank order: the same sum on every rank's chunk owner
        mine += decode(msg)
    every = all_gather(comm, encode(mine), sizes=[s + SCALE_BYTES for s in sizes])
    parts = np.split(every, np.cumsum([s + SCALE_BYTES for s in sizes])[:-1])
    return np.concatenate([decode(m) for m in parts]).reshape(x.shape)


def fp8_bytes_sent(n: int, p: int, rank: int = 0) -> int:
    """What ``fp8_all_reduce`` of n entries sends from ``rank``: codes + a scale to each peer in the
    all-to-all; the ring all-gather forwards every chunk but the one after this rank's."""
    if p == 1:
        return 0
    sizes = split_sizes(n, p)
    to_peers = sum(s + SCALE_BYTES for j, s in enumerate(sizes) if j != rank)
    forwarded = sum(s + SCALE_BYTES for s in sizes) - (sizes[(rank + 1) % p] + SCALE_BYTES)
    return to_peers + forwarded


class Fp8State:
    """The FP8 hook keeps no state (the scale is recomputed per bucket each step)."""


def fp8_hook(state: Fp8State, bucket):
    """FP8 all-reduce hook: encode, all-to-all, add in fp32, encode, all-gather, decode (a sum)."""
    def work(c, x):
        return fp8_all_reduce(c, x).astype(x.dtype, copy=False)
    return bucket.start(work, bucket.flat, f"fp8 all-reduce b{bucket.index}")
