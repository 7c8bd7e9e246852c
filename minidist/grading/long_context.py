"""Grader for exercises/long_context.py: one block of causal attention with its log-sum-exp, and the
online-softmax merge of two blocks.

``CHECKS[task](impl)`` raises AssertionError when ``impl.<task>`` is wrong. Both are held to softmax
attention over all keys at once, computed here from its definition (keys split at random into two
blocks; positions drawn so that some queries see no key of a block). In CI they run against
minidist's own functions (``reference``: must pass) and the deliberately broken versions in ``BROKEN``
(must fail); ``python -m minidist.grade long_context`` runs them on a student's file.
"""

import math
import types
import warnings

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minidist.grading import untouched
from minidist.parallel.context.ring import block_attention, merge_attention

GRADE = settings(max_examples=25, deadline=None, derandomize=True, database=None, report_multiple_bugs=False)


def _attention(q, k, v, q_pos, k_pos):
    """Written out: scores, hidden keys dropped, softmax per query; (out, lse) with 0 / -inf for none."""
    lead, tq, d = q.shape[:-2], q.shape[-2], q.shape[-1]
    out = np.zeros(lead + (tq, d))
    lse = np.full(lead + (tq,), -np.inf)
    for idx in np.ndindex(*lead):
        for i in range(tq):
            seen = [j for j in range(k.shape[-2]) if k_pos[j] <= q_pos[i]]
            if not seen:
                continue
            s = np.array([q[idx][i] @ k[idx][j] / math.sqrt(d) for j in seen])
            w = np.exp(s - s.max())
            out[idx][i] = (w / w.sum()) @ v[idx][seen]
            lse[idx][i] = s.max() + math.log(w.sum())
    return out, lse


@st.composite
def _problem(draw):
    b, tq, tk = draw(st.integers(1, 2)), draw(st.integers(1, 4)), draw(st.integers(2, 6))
    d = draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 999)))
    q, k, v = (rng.standard_normal((b, t, d)) for t in (tq, tk, tk))
    q *= draw(st.sampled_from([1.0, 30.0]))  # large scores: exp overflows unless the maximum is taken out
    q_pos = rng.integers(0, 8, tq)
    k_pos = rng.integers(0, 8, tk)
    return q, k, v, q_pos, k_pos, rng


def _close(got, want, what):
    got_out, got_lse = (np.asarray(a, dtype=np.float64) for a in got)
    want_out, want_lse = want
    assert got_out.shape == want_out.shape and got_lse.shape == want_lse.shape, (
        f"{what}: shapes out {got_out.shape}, lse {got_lse.shape}; expected {want_out.shape}, "
        f"{want_lse.shape}")
    assert not np.isnan(got_out).any() and not np.isnan(got_lse).any(), f"{what}: NaN in the result"
    assert np.array_equal(np.isinf(got_lse), np.isinf(want_lse)), (
        f"{what}: lse must be -inf exactly where a query sees no key; got {got_lse}, expected {want_lse}")
    fin = np.isfinite(want_lse)
    assert np.allclose(got_lse[fin], want_lse[fin], rtol=1e-9, atol=1e-9), f"{what}: lse is wrong"
    assert np.allclose(got_out, want_out, rtol=1e-9, atol=1e-9), (
        f"{what}: out is {np.abs(got_out - want_out).max():.3g} off softmax attention")


def check_block_attention(impl):
    @GRADE
    @given(_problem())
    @example((np.ones((1, 1, 1)), np.ones((1, 2, 1)), np.ones((1, 2, 1)), np.array([0]), np.array([0, 1]),
              None))
    def prop(problem):
        q, k, v, q_pos, k_pos, _ = problem
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "no warning": a log(0) or 0/0 is a failure
            got = untouched(impl.block_attention, ["q", "k", "v", "q_pos", "k_pos"])(
                q.copy(), k.copy(), v.copy(), q_pos.copy(), k_pos.copy())
        _close(got, _attention(q, k, v, q_pos, k_pos), f"block_attention(Tq={len(q_pos)}, Tk={len(k_pos)})")
    prop()


def check_merge_attention(impl):
    @GRADE
    @given(_problem())
    def prop(problem):
        q, k, v, q_pos, k_pos, rng = problem
        in_a = rng.random(k.shape[-2]) < 0.5
        a = _attention(q, k[:, in_a], v[:, in_a], q_pos, k_pos[in_a])
        b = _attention(q, k[:, ~in_a], v[:, ~in_a], q_pos, k_pos[~in_a])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = untouched(impl.merge_attention, ["out_a", "lse_a", "out_b", "lse_b"])(
                a[0].copy(), a[1].copy(), b[0].copy(), b[1].copy())
        _close(got, _attention(q, k, v, q_pos, k_pos), f"merge_attention of {int(in_a.sum())} + "
               f"{int((~in_a).sum())} keys")
    prop()


CHECKS = {"block_attention": check_block_attention, "merge_attention": check_merge_attention}


# -- minidist's own implementation (must pass) ---------------------------------------------------

def reference():
    def block(q, k, v, q_pos, k_pos):
        return block_attention(q, k, v, q_pos, k_pos, 1.0 / math.sqrt(q.shape[-1]), causal=True)
    return types.SimpleNamespace(block_attention=block, merge_attention=merge_attention)


# -- deliberately broken implementations (must fail) ---------------------------------------------

def _diagonal_hidden(q, k, v, q_pos, k_pos):  # a query may not see its own position
    return reference().block_attention(q, k, v, q_pos + 0.5 - 1, k_pos)


def _unscaled(q, k, v, q_pos, k_pos):  # forgets 1/sqrt(D)
    return block_attention(q, k, v, q_pos, k_pos, 1.0, causal=True)


def _average(out_a, lse_a, out_b, lse_b):  # weights the blocks equally, whatever their softmax mass
    return (out_a + out_b) / 2, np.maximum(lse_a, lse_b)


def _naive(out_a, lse_a, out_b, lse_b):  # exponentiates the lse: overflows, and NaN for -inf rows
    with np.errstate(all="ignore"):
        ea, eb = np.exp(lse_a), np.exp(lse_b)
        return (ea[..., None] * out_a + eb[..., None] * out_b) / (ea + eb)[..., None], np.log(ea + eb)


def _merged_into_a(out_a, lse_a, out_b, lse_b):  # right numbers, but reuses the caller's out_a as the output
    out, lse = merge_attention(out_a, lse_a, out_b, lse_b)
    out_a[...] = out
    return out_a, lse


BROKEN = {"block_attention": [_diagonal_hidden, _unscaled],
          "merge_attention": [_average, _naive, _merged_into_a]}
