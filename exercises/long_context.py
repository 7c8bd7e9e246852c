"""Exercise 14: the heart of ring attention -- attention of one block, and the online-softmax merge.

Ring attention (lessons/14-long-context.md) never holds all the keys at once: a rank attends its
queries to one block of keys and values at a time and folds each partial result into a running
one. Two functions make that work, both on NumPy arrays (no autograd, no communication):

* ``block_attention``: causal attention of some queries over one block of keys, returning the
  output AND the log-sum-exp of each query's scores (what the merge needs);
* ``merge_attention``: two such partial results (same queries, disjoint key sets) -> the result
  over the union of the keys, exactly as if they had been attended to together.

Estimated time: 45 min

Grade it:  python -m minidist.grade long_context
The grader draws shapes, positions (so some queries see no key of a block) and splits of the keys,
and compares with softmax attention over all the keys at once.
minidist's answer is minidist/parallel/context/blocks.py (block_attention, merge_attention): try first.
"""

import numpy as np  # noqa: F401  (you will need it)


def block_attention(q, k, v, q_pos, k_pos):
    """Causal attention of queries ``q`` (..., Tq, D) over one block ``k``, ``v`` (..., Tk, D).

    ``q_pos`` (Tq,) and ``k_pos`` (Tk,) are the tokens' positions in the whole sequence: query i
    sees key j iff k_pos[j] <= q_pos[i]. Scores are q·kᵀ / sqrt(D). Return ``(out, lse)``:
    ``out`` (..., Tq, D) = softmax over the visible keys of the scores, times v; ``lse`` (..., Tq)
    = log Σ_visible exp(score). A query that sees no key of this block gets out = 0 and
    lse = -inf (and no warning or NaN anywhere). Subtract the row maximum before exp.
    Does not modify its inputs.
    """
    raise NotImplementedError


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Merge two attentions of the same queries over disjoint key sets A and B: ``(out, lse)``.

    out_a, out_b: (..., T, D); lse_a, lse_b: (..., T), each -inf where that set had no visible key.
    Then lse = log(e^lse_a + e^lse_b) and out = (e^lse_a · out_a + e^lse_b · out_b) / e^lse --
    compute it without overflow (never exponentiate an lse itself, only differences such as
    lse_a - lse) and without NaN where an lse is -inf; if both are -inf, out = 0 and lse = -inf.
    Does not modify its inputs.
    """
    raise NotImplementedError
