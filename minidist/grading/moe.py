"""Grader for exercises/moe.py: top-k routing with capacity, and the Switch load-balancing loss.

``CHECKS[task](impl)`` raises AssertionError when ``impl.<task>`` is wrong. Routing is held to its
rules written out here as a loop (sorted choices, ties to the lower index, first choices before
second choices, token order, capacity); the loss to E · Σ f_e P_e computed here. In CI they run
against minidist's own functions (``reference``: must pass) and the deliberately broken versions in
``BROKEN`` (must fail); ``python -m minidist.grade moe`` runs them on a student's file.
"""

import types

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minidist.grading import untouched
from minidist.nn.moe import routed_fraction, top_k_route

GRADE = settings(max_examples=30, deadline=None, derandomize=True, database=None, report_multiple_bugs=False)


def _route(probs, k, cap):
    """The rules, one assignment at a time."""
    n, e = probs.shape
    order = [sorted(range(e), key=lambda j: (-probs[t, j], j))[:k] for t in range(n)]
    experts = np.array(order).reshape(n, k)
    slots, taken = np.full((n, k), -1), [0] * e
    for j in range(k):
        for t in range(n):
            if taken[experts[t, j]] < cap:
                slots[t, j] = taken[experts[t, j]]
                taken[experts[t, j]] += 1
    return experts, slots


@st.composite
def _probs(draw):
    n, e = draw(st.integers(1, 12)), draw(st.integers(1, 6))
    rng = np.random.default_rng(draw(st.integers(0, 999)))
    logits = rng.integers(0, 3, (n, e)).astype(float) if draw(st.booleans()) else rng.standard_normal((n, e))
    p = np.exp(logits)  # integer logits: many exact ties
    return p / p.sum(axis=1, keepdims=True), draw(st.integers(1, 3)), draw(st.integers(1, 5))


def check_top_k_route(impl):
    @GRADE
    @given(_probs())
    @example((np.array([[0.6, 0.3, 0.1], [0.5, 0.1, 0.4], [0.7, 0.2, 0.1], [0.1, 0.2, 0.7]]), 2, 2))
    def prop(problem):
        probs, k, cap = problem
        k = min(k, probs.shape[1])
        want_e, want_s = _route(probs, k, cap)
        route = untouched(impl.top_k_route, ["probs", "k", "capacity"])
        got_e, got_s = (np.asarray(a) for a in route(probs.copy(), k, cap))
        what = f"top_k_route(N={probs.shape[0]}, E={probs.shape[1]}, k={k}, capacity={cap})"
        assert got_e.shape == want_e.shape and got_s.shape == want_s.shape, (
            f"{what}: shapes {got_e.shape}, {got_s.shape}; expected {want_e.shape} twice")
        assert np.array_equal(got_e, want_e), (
            f"{what}: experts must be sorted by probability, ties to the lower index; got {got_e.tolist()}, "
            f"expected {want_e.tolist()}")
        assert np.array_equal(got_s, want_s), (
            f"{what}: slots (first choices first, in token order; -1 when full) {got_s.tolist()}, "
            f"expected {want_s.tolist()}")
    prop()


def check_load_balancing_loss(impl):
    @GRADE
    @given(_probs())
    def prop(problem):
        probs, k, _ = problem
        n, e = probs.shape
        k = min(k, e)
        experts = _route(probs, k, n)[0]
        f = np.array([(experts == x).sum() for x in range(e)]) / (n * k)
        want = e * float(sum(f[x] * probs[:, x].mean() for x in range(e)))
        got = float(untouched(impl.load_balancing_loss, ["probs", "experts"])(probs.copy(), experts.copy()))
        assert abs(got - want) <= 1e-12, f"load_balancing_loss(N={n}, E={e}, k={k}) = {got}, expected {want}"
    prop()


CHECKS = {"top_k_route": check_top_k_route, "load_balancing_loss": check_load_balancing_loss}


# -- minidist's own implementation (must pass) ---------------------------------------------------

def reference():
    def loss(probs, experts):
        e = probs.shape[1]
        return e * float((routed_fraction(experts, e) * probs.mean(axis=0)).sum())
    return types.SimpleNamespace(top_k_route=top_k_route, load_balancing_loss=loss)


# -- deliberately broken implementations (must fail) ---------------------------------------------

def _token_major(probs, k, cap):  # token 0's second choice before token 1's first
    experts = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    slots, taken = np.full(experts.shape, -1), np.zeros(probs.shape[1], int)
    for t in range(experts.shape[0]):
        for j in range(k):
            if taken[experts[t, j]] < cap:
                slots[t, j] = taken[experts[t, j]]
                taken[experts[t, j]] += 1
    return experts, slots


def _no_capacity(probs, k, cap):  # nothing is ever dropped
    return top_k_route(probs, k, probs.shape[0] * k)


def _unstable_ties(probs, k, cap):  # ties go to the higher index
    e = probs.shape[1]
    flipped_e, _ = top_k_route(probs[:, ::-1], k, probs.shape[0] * k)
    experts = e - 1 - flipped_e
    return experts, _route_slots(experts, probs.shape[1], cap)


def _route_slots(experts, e, cap):
    slots, taken = np.full(experts.shape, -1), np.zeros(e, int)
    for j in range(experts.shape[1]):
        for t in range(experts.shape[0]):
            if taken[experts[t, j]] < cap:
                slots[t, j] = taken[experts[t, j]]
                taken[experts[t, j]] += 1
    return slots


def _no_factor_e(probs, experts):  # forgets the factor E
    return float((routed_fraction(experts, probs.shape[1]) * probs.mean(axis=0)).sum())


def _first_choice_only(probs, experts):  # f from the first choices alone
    e = probs.shape[1]
    return e * float((routed_fraction(experts[:, :1], e) * probs.mean(axis=0)).sum())


def _route_masking_probs(probs, k, capacity):  # right routing, but masks each pick in the caller's probs
    out = top_k_route(probs.copy(), k, capacity)  # (probs[t, best] = -inf) to find the next choice
    rows = np.arange(probs.shape[0])
    for _ in range(k):
        probs[rows, probs.argmax(axis=1)] = -np.inf
    return out


BROKEN = {"top_k_route": [_token_major, _no_capacity, _unstable_ties, _route_masking_probs],
          "load_balancing_loss": [_no_factor_e, _first_choice_only]}
