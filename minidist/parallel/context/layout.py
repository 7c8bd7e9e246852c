"""Which tokens a context-parallel rank holds, and which chunk pairs of them attention computes.

The sequence of T tokens is cut into 2·cp equal chunks and each of the cp ranks holds two:

* **zig-zag** (Megatron-LM's CP): rank r holds chunks r and 2cp-1-r -- one early, one late -- so
  under the causal mask every rank computes the same 2cp+1 chunk pairs;
* **contiguous**: rank r holds chunks 2r and 2r+1, and rank cp-1 does 4cp-1 pairs to rank 0's 3.

A chunk pair (query chunk, key chunk) under the causal mask is fully visible (an earlier key
chunk), the causal triangle (the same chunk: ``diagonal``) or hidden (a later one: not computed).
"""

from __future__ import annotations

import numpy as np

LAYOUTS = ("zigzag", "contiguous")


def check_sequence(t_total: int, cp: int, rank: int = 0) -> int:
    """The chunk length T / (2·cp), or a ValueError saying which lengths work."""
    if t_total % (2 * cp):
        raise ValueError(f"rank {rank}: sequence length {t_total} does not split into 2 x cp = {2 * cp} "
                         f"equal chunks; use a length that is a multiple of {2 * cp}")
    return t_total // (2 * cp)


def chunk_ids(rank: int, cp: int, layout: str = "zigzag") -> tuple[int, int]:
    """The two of the 2·cp chunks rank ``rank`` holds: (r, 2cp-1-r) zig-zag, (2r, 2r+1) contiguous."""
    if layout == "zigzag":
        return rank, 2 * cp - 1 - rank
    if layout == "contiguous":
        return 2 * rank, 2 * rank + 1
    raise ValueError(f"rank {rank}: unknown context-parallel layout {layout!r}; use one of {LAYOUTS}")


def chunk_positions(t_total: int, cp: int, rank: int, layout: str = "zigzag") -> np.ndarray:
    """Global positions of the T/cp tokens rank ``rank`` holds, in the order it holds them."""
    c = check_sequence(t_total, cp, rank)
    return np.concatenate([np.arange(i * c, (i + 1) * c) for i in chunk_ids(rank, cp, layout)])


def shard_sequence(x, cp_rank: int, cp: int, layout: str = "zigzag", axis: int = 1):
    """This rank's tokens of x (e.g. ids (B, T), or targets) along ``axis``."""
    return np.take(x, chunk_positions(x.shape[axis], cp, cp_rank, layout), axis=axis)


def unshard_sequence(parts: list, layout: str = "zigzag", axis: int = 1):
    """Inverse of :func:`shard_sequence`: every rank's part (rank order) -> the whole sequence."""
    cp = len(parts)
    t = sum(p.shape[axis] for p in parts)
    order = np.concatenate([chunk_positions(t, cp, r, layout) for r in range(cp)])
    whole = np.concatenate(parts, axis=axis)
    return np.take(whole, np.argsort(order), axis=axis)


def chunk_pairs(q_chunks, k_chunks, causal: bool = True) -> tuple:
    """The pairs (i, j, diagonal) of query chunk ``q_chunks[i]`` and key chunk ``k_chunks[j]`` that
    see any key, in the order they are merged; hidden pairs are left out."""
    return tuple((i, j, causal and kc == qc) for i, qc in enumerate(q_chunks)
                 for j, kc in enumerate(k_chunks) if not causal or kc <= qc)


def halves(x, axis: int = -2) -> list:
    """The two chunks of a rank's tokens along ``axis`` (views on NumPy)."""
    n = x.shape[axis] // 2
    rest = (slice(None),) * (-axis - 1)
    return [x[(Ellipsis, slice(0, n)) + rest], x[(Ellipsis, slice(n, 2 * n)) + rest]]
