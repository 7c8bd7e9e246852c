"""Recompute policies by number: which blocks a policy keeps, and the activation memory it predicts.

``segment_size`` is the blocks per recomputed segment of a policy ("full": 1, "every_k": k, "sqrt":
round(sqrt(n))). ``block_activation_elements`` is what one GPT Block saves for backward in this
engine, op by op, and ``predicted_peak_activation_bytes`` the peak of saved activations a policy
leaves: the formula chapter 6 (recomputation) prints beside its measurement. Re-exported by
``minidist.parallel.memory.recompute``.
"""

from __future__ import annotations

import math

import numpy as np

POLICIES = ("none", "full", "every_k", "sqrt", "selective")


def segment_size(policy: str, n_layer: int, k: int | None = None) -> int:
    """Blocks per recomputed segment: 1 for "full", k for "every_k", round(sqrt(n)) for "sqrt"."""
    if policy == "full":
        return 1
    if policy == "sqrt":
        return max(1, round(math.sqrt(n_layer)))
    if policy == "every_k":
        if k is None or k < 1:
            raise ValueError(f"policy 'every_k' needs k >= 1 blocks per segment, got k={k}")
        return k
    raise ValueError(f"no segments for policy {policy!r}")


def block_activation_elements(b: int, t: int, c: int, h: int, dropout: bool) -> dict:
    """What one Block saves for backward in this engine, in elements, by op (fused ops, float data).

    ln1: x̂ + rstd (BTC + BT); qkv Linear: its input (BTC); attention core: q, k, v (3BTC) and the
    probabilities (B·H·T²); out-proj input (BTC); ln2 (BTC + BT); fc input (BTC); GELU: x and
    tanh (8BTC); mlp-proj input (4BTC); dropout masks (2BTC when p > 0).
    """
    btc, bt = b * t * c, b * t
    return {"before_core": btc + bt + btc + 3 * btc, "probs": b * h * t * t,
            "after_core": btc + (btc + bt) + btc + 8 * btc + 4 * btc, "dropout": 2 * btc if dropout else 0}


def predicted_peak_activation_bytes(cfg, batch: int, seq: int, policy: str, k: int | None = None) -> int:
    """Peak bytes of saved activations for ``model.loss`` on a (batch, seq) batch under ``policy``.

    none:      E + L·A + Head             (A = one block, E = embedding dropout mask, Head = final
                                           norm, LM-head input, and the loss's logits)
    full/k:    max(E + (L/k)·BTC + Head,  E + max_s[(s+1)·BTC + k_s·A])   -- segment inputs kept,
               one segment recomputed at a time
    selective: max(E + L·(A - BHT²) + Head,  E + L·(A - BHT²) - after_core + BHT²)
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown recompute policy {policy!r}; choose one of {', '.join(POLICIES)}")
    b, t, c, h, n = batch, seq, cfg.d_model, cfg.n_head, cfg.n_layer
    parts = block_activation_elements(b, t, c, h, cfg.dropout > 0)
    a = sum(parts.values())
    emb = b * t * c if cfg.dropout > 0 else 0
    head = (b * t * c + b * t) + b * t * c + (b * t * cfg.vocab_size + b * t)
    if policy == "none":
        elems = emb + n * a + head
    elif policy == "selective":
        kept = n * (a - parts["probs"])
        elems = max(emb + kept + head, emb + kept - parts["after_core"] - parts["dropout"] + parts["probs"])
    else:
        size = segment_size(policy, n, k)
        sizes = [min(size, n - s) for s in range(0, n, size)]
        fwd = emb + len(sizes) * b * t * c + head
        bwd = emb + max((s + 1) * b * t * c + ks * a for s, ks in enumerate(sizes))
        elems = max(fwd, bwd)
    return elems * np.dtype(cfg.dtype).itemsize
