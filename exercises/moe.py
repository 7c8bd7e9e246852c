"""Exercise 15: routing tokens to experts -- top-k with capacity, and the load-balancing loss.

A mixture-of-experts layer (lessons/15-moe.md) sends each token to k of E experts. Each expert has
room for only C tokens (its capacity), so some assignments are dropped; and a loss term keeps the
router from sending everything to a few experts. Both functions work on NumPy arrays.

Estimated time: 40 min

Grade it:  python -m minidist.grade moe
The grader draws router probabilities, k and capacities (ties included) and checks your routing
against the rules below and your loss against the formula.
minidist's answer is minidist/nn/moe.py (top_k_route, MoE._stats): try first.
"""

import numpy as np  # noqa: F401  (you will need it)


def top_k_route(probs, k, capacity):
    """Top-k routing with a capacity per expert.

    ``probs``: (N, E) router probabilities of N tokens; 1 <= k <= E; ``capacity`` >= 1.
    Return ``(experts, slots)``, two (N, k) integer arrays:

    * ``experts[n, j]``: token n's j-th choice -- the experts sorted by probability, highest first,
      equal probabilities broken towards the lower expert index;
    * ``slots[n, j]``: the slot (0, 1, 2, ...) that assignment takes in its expert's buffer, or -1
      if the expert was already full (the assignment is dropped). Slots are handed out in this
      priority: every token's FIRST choice, in token order 0..N-1; then every token's second choice,
      in token order; and so on. An expert's slots are 0..(taken - 1), never more than ``capacity``.
    Does not modify its inputs.
    """
    raise NotImplementedError


def load_balancing_loss(probs, experts):
    """The Switch Transformer's auxiliary loss, a float: E · Σ_e f_e · P_e.

    ``probs`` (N, E) as above; ``experts`` (N, k) the choices of ``top_k_route`` (dropped or not).
    f_e = the fraction of the N·k choices that name expert e; P_e = the mean of probs[:, e] over
    the N tokens. It is 1 when routing is perfectly uniform and up to E when it all goes one way.
    Does not modify its inputs.
    """
    raise NotImplementedError
