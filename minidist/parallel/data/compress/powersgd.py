"""PowerSGD (Vogels et al. 2019): a rank-r approximation of each gradient matrix, by one power step.

For each n x m gradient matrix M (a parameter of 2+ dims, reshaped to (shape[0], rest)) of a bucket:

    M += residual                         error feedback: what earlier steps did not send
    P  = M Q            all-reduce P      (n x r; Q is m x r, warm-started: last step's Q)
    P  = orthogonalize(P)                 Gram-Schmidt; a column below epsilon becomes zero
    Q  = Mᵀ P           all-reduce Q      (m x r)
    M̂  = P Qᵀ                            = P Pᵀ Σ_r M_r: the same on every rank
    residual = M - M̂ / p                  (this rank's share of what was not sent)

So one step sends (n + m)·r numbers per matrix instead of n·m. 1-D tensors (biases, norms) go
uncompressed in the first all-reduce, beside the P's. For the first ``start_iter`` steps the bucket
is all-reduced densely (PyTorch's ``start_powerSGD_iter``: early gradients change too fast).
With r = min(n, m), P Pᵀ projects onto the whole column space: PowerSGD equals the dense sum.
"""

from __future__ import annotations

import numpy as np

from minidist.comm import all_reduce


def orthogonalize(P, eps: float | None = None):
    """Modified Gram-Schmidt on P's columns, in place: each is normalised, then removed from the
    columns after it. A column whose norm is at most ``eps`` times the largest input column's is
    set to zero -- it was zero or dependent, and normalising its rounding noise would add a random
    direction (or NaN). ``eps`` None: 1000 machine epsilons of P's dtype."""
    eps = 1000 * np.finfo(P.dtype).eps if eps is None else eps
    floor = eps * max(float(np.linalg.norm(P, axis=0).max(initial=0.0)), np.finfo(P.dtype).tiny)
    for i in range(P.shape[1]):
        col = P[:, i]
        norm = np.linalg.norm(col)
        if norm <= floor:
            col[...] = 0
            continue
        col /= norm
        if i + 1 < P.shape[1]:
            P[:, i + 1:] -= np.outer(col, col @ P[:, i + 1:])
    return P


def matrix_shape(shape) -> tuple | None:
    """(n, m) a parameter of ``shape`` is compressed as, or None for a 1-D one (sent as is)."""
    if len(shape) < 2:
        return None
    return shape[0], int(np.prod(shape[1:], dtype=np.int64))


class PowerSGDState:
    """``rank``: r; ``start_iter``: dense steps first; ``error_feedback``, ``warm_start`` (reuse Q);
    ``seed``: the first Q (drawn alike on every rank); ``eps``: Gram-Schmidt's zero-column threshold."""

    def __init__(self, rank=2, start_iter=0, error_feedback=True, warm_start=True, seed=0, eps=None):
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"PowerSGD rank={rank!r} must be an integer >= 1")
        self.rank, self.start_iter, self.seed, self.eps = rank, start_iter, seed, eps
        self.error_feedback, self.warm_start = error_feedback, warm_start
        self.iter = 0
        self.residuals: dict = {}
        self.qs: dict = {}
        self.rngs: dict = {}

    def fresh_q(self, bucket: int, j: int, q):
        """Random columns for Q where it has none (the first step; columns gone to zero), drawn from a
        generator per matrix: the same on every rank, since every rank makes the same draws."""
        rng = self.rngs.setdefault((bucket, j), np.random.default_rng([self.seed, bucket, j]))
        dead = ~q.any(axis=0)
        if dead.any():
            q[:, dead] = rng.standard_normal((q.shape[0], int(dead.sum()))).astype(q.dtype)
        return q


def powersgd_step(c, state: PowerSGDState, bucket, x):
    """The compressed sum of flat gradient ``x`` (the work of ``powersgd_hook``, on the worker)."""
    res = state.residuals.get(bucket.index)
    flat = x if res is None else x + res
    views = bucket.views(flat)
    mats = {j: v.reshape(matrix_shape(v.shape)) for j, v in enumerate(views) if matrix_shape(v.shape)}
    vecs = [j for j in range(len(views)) if j not in mats]
    qs = {}
    for j, M in mats.items():
        r = min(state.rank, *M.shape)
        q = state.qs.get((bucket.index, j)) if state.warm_start else None
        qs[j] = state.fresh_q(bucket.index, j, np.zeros((M.shape[1], r), M.dtype) if q is None else q)
    ps = [mats[j] @ qs[j] for j in mats]
    first = all_reduce(c, np.concatenate([p.reshape(-1) for p in ps] + [views[j].reshape(-1) for j in vecs]),
                       op="sum", algorithm=bucket.algorithm)
    out, o = np.empty_like(flat), 0
    out_views = bucket.views(out)
    for p in ps:
        p[...] = first[o:o + p.size].reshape(p.shape)
        o += p.size
        orthogonalize(p, state.eps)
    for j in vecs:
        out_views[j][...] = first[o:o + views[j].size].reshape(views[j].shape)
        o += views[j].size
    second = all_reduce(c, np.concatenate([(mats[j].T @ p).reshape(-1) for j, p in zip(mats, ps)]
                                          or [np.zeros(0, x.dtype)]), op="sum", algorithm=bucket.algorithm)
    o = 0
    for j, p in zip(mats, ps):
        q = second[o:o + qs[j].size].reshape(qs[j].shape)
        o += q.size
        state.qs[(bucket.index, j)] = q
        out_views[j][...] = (p @ q.T).reshape(out_views[j].shape)
    if state.error_feedback:  # this rank keeps its share of what the approximation missed
        residual = flat - out / x.dtype.type(c.size)
        res_views = bucket.views(residual)
        for j in vecs:
            res_views[j][...] = 0  # sent exactly
        state.residuals[bucket.index] = residual
    return out


def powersgd_hook(state: PowerSGDState, bucket):
    """PowerSGD: dense for the first ``start_iter`` steps, then rank-r with error feedback."""
    dense = state.iter < state.start_iter
    if bucket.is_last:
        state.iter += 1
    if dense:
        return bucket.start(lambda c, x: all_reduce(c, x, op="sum", algorithm=bucket.algorithm), bucket.flat,
                            f"all-reduce b{bucket.index} (PowerSGD warm-up)")
    return bucket.start(lambda c, x: powersgd_step(c, state, bucket, x), bucket.flat,
                        f"powersgd b{bucket.index}")
