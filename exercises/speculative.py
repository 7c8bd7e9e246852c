"""Exercise 9b: speculative decoding's acceptance rule -- keep the target's distribution exactly.

A small draft model proposes tokens d_1..d_k, each drawn from its distribution q_i; the target
model scores them all in one pass, giving its distributions p_1..p_{k+1}. Rejection sampling
(Leviathan et al. 2023; Chen et al. 2023) decides which proposals survive so that every emitted
token is distributed exactly as if the target had sampled it alone -- whatever the draft.

Estimated time: 45 min (residual 10 min, verify 25 min, speed-up 10 min)
Points: residual 2, verify 4, expected_speedup 1.
Grade it:  python -m minidist.grade speculative
The grader checks your rule round by round against the paper's, and draws thousands of rounds
to test (chi-square) that the first emitted token is distributed as p_1. Lesson:
lessons/09-inference.md; minidist's answer is minidist/infer/speculative.py: try first.
"""

import numpy as np  # noqa: F401  (you will need it)


def residual(p, q):
    """The distribution a rejected proposal's replacement is drawn from: max(0, p - q) normalised
    to sum to 1, as a float64 array (V,). If p - q is nowhere positive (p == q), return p.
    Does not modify its inputs."""
    raise NotImplementedError


def verify(p, q, drafts, u, v):
    """The list of tokens one round emits: the accepted proposals, then one more token.

    p (k+1, V): the target's distributions at each proposal's position and after the last one;
    q (k, V): the draft's distributions; ``drafts``: the k proposed token ids; ``u`` (k,) and ``v``:
    uniform random numbers in [0, 1).

    Go through the proposals in order: d_i is accepted iff u_i < p_i(d_i) / q_i(d_i). At the first
    rejection, emit ``pick(residual(p_i, q_i), v)`` and stop. If all k are accepted, emit one more:
    ``pick(p_{k+1}, v)`` (p[k], the target's distribution after the last proposal).

    ``pick(dist, v)`` draws by inverse CDF: the first index j with cumsum(dist)[j] > v * sum(dist).
    Does not modify its inputs.
    """
    raise NotImplementedError


def expected_speedup(a, k, c):
    """The expected speed-up over plain decoding when each proposal is accepted with probability a
    (independently), k tokens are proposed per round, and one draft step costs c target steps:
    the expected tokens per round, 1 + a + a^2 + ... + a^k, over a round's cost, k·c + 1."""
    raise NotImplementedError
