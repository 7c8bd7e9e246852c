"""Grader for exercises/speculative.py: speculative decoding's residual, acceptance rule and speed-up.

``verify`` is checked two ways: round by round against the rule written out here (which proposals
survive, what replaces the first rejected one, the free token when all survive), and in
distribution -- thousands of rounds with proposals drawn from q, and the first emitted token's
counts must fit p_1 (a chi-square test at p < 1e-4 under a fixed seed: a correct rule fails with
probability 1e-4 over seeds, and with this seed never). ``chi_square_pvalue`` is shared with
minidist's own test of ``speculative_generate`` (tests/infer/test_speculative.py).
"""

import math
import types

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minidist.grading import assert_close, untouched
from minidist.infer import speculative as spec

GRADE = settings(max_examples=25, deadline=None, derandomize=True, database=None, report_multiple_bugs=False)
ALPHA = 1e-4  # the chi-square test's false-alarm rate


def chi_square_pvalue(observed, expected, min_expected: float = 5.0) -> float:
    """P(chi-square >= the statistic) for counts ``observed`` against ``expected`` (same total).

    Cells expected fewer than ``min_expected`` times are pooled (the test's usual validity rule), and
    the two smallest are merged while the degrees of freedom are odd, so the tail is exact:
    for df = 2m, P = exp(-x/2) · sum_{i<m} (x/2)^i / i!."""
    o, e = np.asarray(observed, np.float64), np.asarray(expected, np.float64)
    order = np.argsort(e)
    o, e = list(o[order]), list(e[order])
    while len(e) > 1 and (e[0] < min_expected or len(e) % 2 == 0):  # pool the smallest two
        o, e = [o[0] + o[1], *o[2:]], [e[0] + e[1], *e[2:]]
        order = np.argsort(e)
        o, e = [o[i] for i in order], [e[i] for i in order]
    if len(e) < 2:
        return 1.0
    x = sum((a - b) ** 2 / b for a, b in zip(o, e))
    term, total = 1.0, 0.0
    for i in range((len(e) - 1) // 2):
        total += term
        term *= (x / 2) / (i + 1)
    return float(math.exp(-x / 2) * total)


def _pick(dist, v):
    c = np.cumsum(dist)
    return int(min(np.searchsorted(c, v * c[-1], side="right"), len(c) - 1))


def _dist(rng, vocab, peaked):
    z = rng.standard_normal(vocab) * (3.0 if peaked else 1.0)
    if peaked:
        z[rng.integers(vocab)] = -np.inf  # a token this distribution never gives
    p = np.exp(z - z.max())
    return p / p.sum()


distributions = st.tuples(st.integers(2, 6), st.integers(0, 999), st.booleans())


def check_residual(impl):
    @GRADE
    @given(spec=distributions)
    @example(spec=(3, 0, True))
    def prop(spec):
        vocab, seed, peaked = spec
        rng = np.random.default_rng(seed)
        p, q = _dist(rng, vocab, peaked), _dist(rng, vocab, not peaked)
        want = np.maximum(p - q, 0) / np.maximum(p - q, 0).sum()
        residual = untouched(impl.residual, ["p", "q"])
        assert_close(residual(p, q), want, f"p={np.round(p, 3)}, q={np.round(q, 3)}: "
                                           "max(0, p - q) normalised", rtol=1e-9, atol=1e-12)
        assert_close(impl.residual(p, p.copy()), p, f"p == q = {np.round(p, 3)} (return p)", rtol=1e-12)
    prop()


def check_verify(impl):
    @GRADE
    @given(spec=distributions, k=st.integers(1, 4))
    @example(spec=(3, 1, True), k=2)
    def rounds(spec, k):
        vocab, seed, peaked = spec
        rng = np.random.default_rng(seed)
        p = np.stack([_dist(rng, vocab, peaked) for _ in range(k + 1)])
        q = np.stack([_dist(rng, vocab, not peaked) for _ in range(k)])
        drafts = [_pick(q[i], rng.random()) for i in range(k)]
        u, v = rng.random(k), float(rng.random())
        want = []
        for i, d in enumerate(drafts):  # the rule, from the paper
            if u[i] < p[i, d] / q[i, d]:
                want.append(d)
            else:
                r = np.maximum(p[i] - q[i], 0)
                want.append(_pick(r / r.sum() if r.sum() > 0 else p[i], v))
                break
        else:
            want.append(_pick(p[k], v))
        got = untouched(impl.verify, ["p", "q", "drafts", "u", "v"])(p, q, drafts, u, v)
        assert [int(t) for t in got] == want, (
            f"k={k}, drafts {drafts}, u={np.round(u, 3)}, v={v:.3f}, p(d)/q(d)="
            f"{[round(float(p[i, d] / q[i, d]), 3) for i, d in enumerate(drafts)]}: emitted "
            f"{list(got)}, expected {want}")
    rounds()
    for vocab, seed in ((3, 7), (5, 11)):  # in distribution: the first token must be ~ p_1
        rng = np.random.default_rng(seed)
        p, q = np.stack([_dist(rng, vocab, True), _dist(rng, vocab, True)]), _dist(rng, vocab, False)[None]
        n = 20000
        counts = np.zeros(vocab)
        for _ in range(n):
            d = _pick(q[0], rng.random())
            counts[int(impl.verify(p, q, [d], rng.random(1), float(rng.random()))[0])] += 1
        pv = chi_square_pvalue(counts, n * p[0])
        assert pv >= ALPHA, (f"over {n} rounds with k=1, the first emitted token's counts "
                             f"{counts.astype(int).tolist()} don't fit the target's p = {np.round(p[0], 3)} "
                             f"(expected {np.round(n * p[0]).astype(int).tolist()}): chi-square p-value "
                             f"{pv:.2g} < {ALPHA:g}; the draft is q = {np.round(q[0], 3)}")


def check_expected_speedup(impl):
    cases = [(0.0, 3, 0.0, 1.0), (0.5, 2, 0.0, 1.75), (1.0, 4, 0.0, 5.0), (1.0, 4, 0.25, 2.5),
             (0.8, 4, 0.1, (1 + 0.8 + 0.64 + 0.512 + 0.4096) / 1.4), (0.6, 1, 0.5, 1.6 / 1.5)]
    for a, k, c, want in cases:
        got = impl.expected_speedup(a, k, c)
        assert got is not None and abs(float(got) - want) < 1e-9, (
            f"a={a}, k={k}, c={c}: got {got}, expected (1 + a + ... + a^k) / (k·c + 1) = {want:.6g}")


CHECKS = {"residual": check_residual, "verify": check_verify, "expected_speedup": check_expected_speedup}
POINTS = {"residual": 2, "verify": 4, "expected_speedup": 1}


# -- minidist's own answer (must pass) -------------------------------------------------------------

def reference():
    return types.SimpleNamespace(residual=spec.residual, verify=spec.verify,
                                 expected_speedup=spec.expected_speedup)


# -- deliberately broken implementations (must fail) -----------------------------------------------

def _residual_unclipped(p, q):  # p - q without max(0, .): negative "probabilities"
    r = np.asarray(p, np.float64) - q
    return r / r.sum() if abs(r.sum()) > 1e-12 else np.asarray(p, np.float64)


def _residual_is_p(p, q):  # a rejected token redrawn from p: the draft's share is counted twice
    return np.asarray(p, np.float64)


def _verify_with(p, q, drafts, u, v, accept, replace=None, bonus=True):
    out = []
    for i, d in enumerate(drafts):
        if accept(p[i][d], q[i][d], u[i]):
            out.append(int(d))
            continue
        out.append(_pick((replace or _reference_residual)(p[i], q[i]), v))
        return out
    return out + [_pick(p[len(drafts)], v)] if bonus else out


def _reference_residual(p, q):
    r = np.maximum(np.asarray(p, np.float64) - q, 0.0)
    return r / r.sum() if r.sum() > 0 else np.asarray(p, np.float64)


def _verify_greedy_accept(p, q, drafts, u, v):  # keeps a proposal when p >= q, ignoring u
    return _verify_with(p, q, drafts, u, v, lambda pd, qd, ui: pd >= qd)


def _verify_ratio_flipped(p, q, drafts, u, v):  # u < q/p instead of p/q
    return _verify_with(p, q, drafts, u, v, lambda pd, qd, ui: ui * pd < qd)


def _verify_no_bonus(p, q, drafts, u, v):  # all accepted, and the free token from p_{k+1} forgotten
    return _verify_with(p, q, drafts, u, v, lambda pd, qd, ui: ui * qd < pd, bonus=False)


def _verify_resample_from_p(p, q, drafts, u, v):  # the replacement drawn from p, not the residual
    return _verify_with(p, q, drafts, u, v, lambda pd, qd, ui: ui * qd < pd, replace=_residual_is_p)


def _speedup_no_plus_one(a, k, c):  # the target's own verify pass left out of the cost
    return sum(a ** i for i in range(k + 1)) / (k * c) if c else float("inf")


def _speedup_k_terms(a, k, c):  # 1 + a + ... + a^(k-1): the free token forgotten
    return sum(a ** i for i in range(k)) / (k * c + 1)


def _residual_in_place(p, q):  # right distribution, computed in the caller's p
    p -= q
    np.maximum(p, 0, out=p)
    p /= p.sum()
    return p


BROKEN = {"residual": [_residual_unclipped, _residual_is_p, _residual_in_place],
          "verify": [_verify_greedy_accept, _verify_ratio_flipped, _verify_no_bonus, _verify_resample_from_p],
          "expected_speedup": [_speedup_no_plus_one, _speedup_k_terms]}
