"""Exercise 12: send fewer bytes -- top-k with error feedback, and one PowerSGD step.

A data-parallel step all-reduces every gradient entry. Two ways to send far less:

* **top-k with error feedback**: send only the k entries of largest magnitude, keep the rest as a
  residual that is added to the next step's gradient, so nothing is lost, only delayed.
* **PowerSGD**: approximate the summed gradient matrix by rank r, with one step of power iteration
  whose two all-reduces carry (n + m)·r numbers instead of n·m.

Estimated time: 45 min (top-k with error feedback 15 min, PowerSGD step 30 min)
Grade it:  python -m minidist.grade compression
The grader checks top-k against the spec on random gradients (exact sums, no entry lost), and your
PowerSGD step on 1..3 thread ranks against a QR-based computation of the same projection.
Lesson: lessons/12-compression.md; minidist's answer is minidist/parallel/data/compress/sparse.py
(ef_sparsify) and powersgd.py (powersgd_step, orthogonalize), so try before you look.
"""

import numpy as np  # noqa: F401  (you will need it)

from minidist.comm import all_reduce  # noqa: F401  (you will need it)


def topk_with_error_feedback(grad, residual, k):
    """Top-k sparsification with error feedback, on one rank (no communication).

    ``grad`` and ``residual`` are 1-D float arrays of the same length n (``residual`` may be None:
    zeros); 1 <= k <= n. Let m = grad + residual. Return ``(indices, values, new_residual)``:
    ``indices`` -- k distinct positions of the entries of m with the largest ABSOLUTE values (any
    order; ties broken any way), ``values`` = m[indices], and ``new_residual`` = m with those k
    entries set to 0. Then sending (indices, values) and keeping new_residual loses nothing:
    scatter(indices, values) + new_residual == grad + residual exactly. Don't modify the inputs.
    """
    raise NotImplementedError


def powersgd_step(comm, M, Q):
    """One PowerSGD step for one gradient matrix, SPMD on every rank of ``comm``.

    ``M``: this rank's n x m gradient (float64); ``Q``: an m x r matrix, the same on every rank
    (r <= min(n, m)). With S = the sum of every rank's M (never formed -- that is the point):

    1. P = M @ Q on each rank, then all-reduce P (sum): now P = S @ Q, n x r.
    2. Orthonormalize P's columns (Gram-Schmidt: for each column i, divide it by its norm, then
       subtract its component from every later column).
    3. Q_new = M.T @ P on each rank, then all-reduce Q_new (sum): now Q_new = S.T @ P, m x r.
    4. Return ``(P @ Q_new.T, Q_new)``: the rank-r approximation of S (the same on every rank), and
       Q_new (next step's warm start).

    Use ``all_reduce(comm, x)`` (the sum over ranks) for the two all-reduces.
    Does not modify its inputs.
    """
    raise NotImplementedError
