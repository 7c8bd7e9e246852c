"""Top-k and random-k sparsification with error feedback (Deep Gradient Compression, Stich et al.).

Each rank sends only k = ceil(ratio · n) entries of its bucket, as (index, value) pairs, and keeps
what it did not send as a **residual** that is added to the next step's gradient (error feedback):

    m = g + residual;  idx = select(m, k);  send (idx, m[idx]);  residual = m with m[idx] zeroed

so nothing is ever lost, only delayed: sent + new residual == g + old residual, exactly (they
have disjoint supports). Without the residual top-k is biased (small coordinates never move).

The pairs travel by all-gather (int32 indices, values in the gradient's dtype), and every rank adds
all p sparse vectors in rank order (the sparse sum): the same result on every rank. Bytes per rank:
(p-1)·k·(4 + itemsize). Random-k draws its k indices from a per-rank generator instead of |m|.
"""

from __future__ import annotations

import math

import numpy as np

from minidist.comm import all_gather


def topk_indices(m, k: int) -> np.ndarray:
    """The k entries of largest magnitude, as sorted int32 indices (ties: argpartition's choice)."""
    if k >= m.size:
        return np.arange(m.size, dtype=np.int32)
    return np.sort(np.argpartition(np.abs(m), m.size - k)[m.size - k:]).astype(np.int32)


def ef_sparsify(grad, residual, k: int, select=topk_indices):
    """(indices, values, new residual) of ``grad + residual`` (residual None: zeros) with k kept."""
    m = grad.copy() if residual is None else grad + residual
    idx = select(m, k)
    values = m[idx]
    m[idx] = 0
    return idx, values, m


def sparse_sum(comm, idx, values, n: int):
    """Σ over ranks of the sparse vectors (idx, values) of length n: all-gather the pairs (every rank
    sends as many), then add them in rank order -- the same sum on every rank."""
    k = idx.size
    all_idx = all_gather(comm, idx, sizes="equal")
    all_val = all_gather(comm, values, sizes="equal")
    out = np.zeros(n, values.dtype)
    for r in range(comm.size):  # indices within one rank are distinct: a plain += is a scatter-add
        out[all_idx[r * k:(r + 1) * k]] += all_val[r * k:(r + 1) * k]
    return out


class SparseState:
    """``kind``: "topk" or "randk"; ``ratio``: the fraction of entries sent (k = ceil(ratio · n));
    ``error_feedback``: keep the residual per bucket; ``seed``: random-k's generator (per rank)."""

    def __init__(self, kind="topk", ratio=0.01, error_feedback=True, seed=0):
        if kind not in ("topk", "randk"):
            raise ValueError(f"sparsification kind={kind!r}; use 'topk' or 'randk'")
        if not 0 < ratio <= 1:
            raise ValueError(f"sparsification ratio={ratio!r} must be in (0, 1]")
        self.kind, self.ratio, self.error_feedback, self.seed = kind, ratio, error_feedback, seed
        self.residuals: dict = {}
        self.rng = None

    def k(self, n: int) -> int:
        return min(n, max(1, math.ceil(self.ratio * n)))

    def selector(self, rank: int):
        if self.kind == "topk":
            return topk_indices
        if self.rng is None:
            self.rng = np.random.default_rng([self.seed, rank])
        return lambda m, k: np.sort(self.rng.choice(m.size, k, replace=False)).astype(np.int32)


def sparse_hook(state: SparseState, bucket):
    """Top-k / random-k with error feedback: send k (index, value) pairs, sum them sparsely."""
    def work(c, x):
        idx, values, residual = ef_sparsify(x, state.residuals.get(bucket.index), state.k(x.size),
                                            state.selector(c.rank))
        if state.error_feedback:
            state.residuals[bucket.index] = residual
        return sparse_sum(c, idx, values, x.size)
    return bucket.start(work, bucket.flat, f"{state.kind} b{bucket.index}")
