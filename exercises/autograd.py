"""Exercise 1: write the backward passes of the ops a GPT spends its time in.

Each function gets NumPy float64 arrays: the op's inputs and ``g``, the gradient of the loss with
respect to the op's output, and returns the gradients with respect to the inputs. No autograd:
derive each formula on paper first. Lesson: lessons/01-train.md; the answers are in
minidist/autograd/ops/, so try before you look.

Estimated time: 2-3 h (linear 20 min, layer norm 45 min, cross-entropy 30 min, attention 1 h)
Grade it:  python -m minidist.grade autograd
"""

import numpy as np  # noqa: F401  (you will need it)


def linear_backward(x, w, g):
    """y = x @ w + b with x (..., n), w (n, m), b (m,); g has y's shape (..., m).

    Return (gx, gw, gb) shaped like x, w and b. The batch axes of x are summed out of gw and gb.
    Does not modify its inputs.
    """
    raise NotImplementedError


def layer_norm_backward(x, w, g, eps=1e-5):
    """y = (x - mean) / sqrt(var + eps) * w + b over the last axis of x (..., n); w, b (n,).

    Return (gx, gw, gb). Hint: with xhat = (x - mean) * rstd,
    gx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)) where dxhat = g * w.
    Does not modify its inputs.
    """
    raise NotImplementedError


def cross_entropy_backward(logits, targets):
    """loss = mean over rows of -log softmax(logits)[row, targets[row]]; logits (N, V), targets (N,).

    Return d loss / d logits, shape (N, V).
    Does not modify its inputs.
    """
    raise NotImplementedError


def attention_backward(q, k, v, g):
    """y = softmax(q kᵀ / sqrt(d) + causal mask) v over (B, H, T, d) arrays; g has y's shape.

    Return (gq, gk, gv). Position i attends to positions <= i.
    Does not modify its inputs.
    """
    raise NotImplementedError
