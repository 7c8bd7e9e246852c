"""Grader for exercises/compression.py: top-k with error feedback, and one PowerSGD step.

``CHECKS[task](impl)`` raises AssertionError when ``impl.<task>`` is wrong. Top-k is held to its spec
written out here (the k largest magnitudes, nothing lost: exact sums); the PowerSGD step, on 1..3
thread ranks, to the same projection computed another way (NumPy's QR of the summed P: column signs
may differ, the projection P Pᵀ S may not). In CI they run against minidist's own hooks (``reference``:
must pass) and the deliberately broken versions in ``BROKEN`` (must fail);
``python -m minidist.grade compression`` runs them on a student's file.
"""

import types

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minidist.comm import all_reduce
from minidist.grading import no_hang, run_guarded, untouched
from minidist.parallel.data.compress import PowerSGDState, ef_sparsify, powersgd_hook, reduce_with_hook

GRADE = settings(max_examples=15, deadline=None, derandomize=True, database=None, report_multiple_bugs=False)
WAIT_S = 10


def check_topk_with_error_feedback(impl):
    @GRADE
    @given(n=st.integers(1, 30), k=st.integers(1, 30), seed=st.integers(0, 99), with_res=st.booleans())
    @example(n=4, k=2, seed=0, with_res=True)
    def prop(n, k, seed, with_res):
        k = min(k, n)
        rng = np.random.default_rng(seed)
        g = rng.standard_normal(n)
        res = rng.standard_normal(n) if with_res else None
        g0, res0 = g.copy(), None if res is None else res.copy()
        idx, values, new_res = untouched(impl.topk_with_error_feedback, ["grad", "residual", "k"])(g, res, k)
        what = f"topk_with_error_feedback(n={n}, k={k}, residual={'given' if with_res else None})"
        idx, values, new_res = np.asarray(idx).astype(np.int64), np.asarray(values), np.asarray(new_res)
        assert np.array_equal(g, g0) and (res is None or np.array_equal(res, res0)), \
            f"{what} changed its inputs"
        assert idx.shape == (k,) and len(set(idx.tolist())) == k, \
            f"{what}: need {k} distinct indices, got {idx}"
        m = g0 + res0 if with_res else g0
        assert np.array_equal(values, m[idx]), f"{what}: values must be (grad + residual)[indices]"
        want = np.sort(np.abs(m))[::-1][:k]
        assert np.array_equal(np.sort(np.abs(values))[::-1], want), (
            f"{what}: the indices must be the {k} largest |grad + residual|; got |values| {np.abs(values)}")
        sent = np.zeros(n)
        sent[idx] = values
        assert np.array_equal(sent + new_res, m), (
            f"{what}: sent + new residual must equal grad + residual exactly (error feedback loses nothing)")
        assert np.all(new_res[idx] == 0), f"{what}: the sent entries must be 0 in the new residual"
    prop()


def _expected(ms, Q):
    """The projection of S = Σ M onto the span of S Q, and S.T P, by QR (not Gram-Schmidt)."""
    S = sum(ms)
    P, _ = np.linalg.qr(S @ Q)
    return P @ P.T @ S, S.T @ P


def check_powersgd_step(impl):
    @GRADE
    @given(p=st.integers(1, 3), n=st.integers(1, 6), m=st.integers(1, 6), r=st.integers(1, 3),
           seed=st.integers(0, 99))
    @example(p=2, n=4, m=3, r=2, seed=0)
    def prop(p, n, m, r, seed):
        r = min(r, n, m)
        rng = np.random.default_rng(seed)
        ms = [rng.standard_normal((n, m)) for _ in range(p)]
        Q = rng.standard_normal((m, r))
        want_approx, want_q = _expected(ms, Q)
        step = untouched(impl.powersgd_step, ["comm", "M", "Q"])
        out = run_guarded(lambda comm: step(comm, ms[comm.rank].copy(), Q.copy()), p, WAIT_S)
        what = f"powersgd_step on {p} ranks, M {n}x{m}, r={r}"
        for rank, (approx, q_new) in enumerate(out):
            approx, q_new = np.asarray(approx), np.asarray(q_new)
            assert approx.shape == (n, m) and q_new.shape == (m, r), (
                f"{what}: rank {rank} returned shapes {approx.shape}, {q_new.shape}; "
                f"expected {(n, m)}, {(m, r)}")
            assert np.allclose(approx, want_approx, rtol=1e-8, atol=1e-8), (
                f"{what}: rank {rank}'s approximation is {np.abs(approx - want_approx).max():.3g} off "
                "P Pᵀ S (P: the orthonormalized, summed M Q)")
            signs = np.sign(np.sum(q_new * want_q, axis=0))  # Gram-Schmidt and QR may flip columns
            signs[signs == 0] = 1
            assert np.allclose(q_new, want_q * signs, rtol=1e-8, atol=1e-8), (
                f"{what}: rank {rank}'s Q_new is not Sᵀ P (summed over ranks)")
            assert np.array_equal(approx, np.asarray(out[0][0])), f"{what}: rank {rank} differs from rank 0"
    no_hang(prop)


CHECKS = {"topk_with_error_feedback": check_topk_with_error_feedback, "powersgd_step": check_powersgd_step}


# -- minidist's own implementation (must pass) ---------------------------------------------------

def _reference_powersgd_step(comm, M, Q):
    state = PowerSGDState(rank=Q.shape[1], error_feedback=False)
    state.qs[(0, 0)] = Q
    approx = reduce_with_hook(comm, state, powersgd_hook, M.reshape(-1), [M.shape])
    return approx.reshape(M.shape), state.qs[(0, 0)]


def reference():
    return types.SimpleNamespace(topk_with_error_feedback=ef_sparsify, powersgd_step=_reference_powersgd_step)


# -- deliberately broken implementations (must fail) ---------------------------------------------

def _no_feedback(grad, residual, k):  # forgets the residual it was given
    idx, values, _ = ef_sparsify(grad, None, k)
    return idx, values, np.zeros_like(grad)


def _largest_not_magnitude(grad, residual, k):  # the k largest values: big negative entries never go
    m = grad if residual is None else grad + residual
    idx = np.argsort(m)[::-1][:k]
    rest = m.copy()
    rest[idx] = 0
    return idx, m[idx], rest


def _no_orthogonalization(comm, M, Q):  # columns normalised but not made orthogonal
    P = all_reduce(comm, M @ Q)
    P = P / np.linalg.norm(P, axis=0)
    Q_new = all_reduce(comm, M.T @ P)
    return P @ Q_new.T, Q_new


def _local_q(comm, M, Q):  # skips the second all-reduce: each rank projects only its own M
    P, _ = np.linalg.qr(all_reduce(comm, M @ Q))
    Q_new = M.T @ P
    return P @ Q_new.T, Q_new


def _residual_accumulated_in_place(grad, residual, k):  # right numbers, but `residual += grad` writes
    residual += grad                                     # into the caller's residual
    return ef_sparsify(residual, np.zeros_like(residual), k)


BROKEN = {"topk_with_error_feedback": [_no_feedback, _largest_not_magnitude, _residual_accumulated_in_place],
          "powersgd_step": [_no_orthogonalization, _local_q]}

