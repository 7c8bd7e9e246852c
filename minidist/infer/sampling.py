"""Choosing the next token from logits: greedy, temperature, top-k, top-p (nucleus), seeded.

Every sequence draws with its own ``numpy.random.Generator`` (seeded from its request), so the
tokens it draws don't depend on which other sequences share its batch: batched, continuous-batched
and sharded generation sample exactly what one-at-a-time generation does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0

    def __post_init__(self):
        if not 0 <= self.temperature < float("inf"):  # NaN fails this too
            raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k is not None and not (is_int(self.top_k) and self.top_k >= 1):
            raise ValueError(f"top_k must be an integer >= 1 or None, got {self.top_k!r}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] or None, got {self.top_p}")
        if not (is_int(self.seed) and self.seed >= 0):
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")

    def generator(self, stream: int = 0) -> np.random.Generator:
        """This sequence's generator: seed and stream (e.g. the request id) together."""
        return np.random.default_rng([self.seed, stream])


GREEDY = SamplingParams()


def filter_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution sampling draws from, (V,) float64: temperature, then top-k, then top-p."""
    z = np.asarray(logits, dtype=np.float64) / params.temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if params.top_k is not None and params.top_k < p.size:
        kth = np.partition(p, -params.top_k)[-params.top_k]
        p = np.where(p >= kth, p, 0.0)
    if params.top_p is not None and params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]  # mass strictly above each token
        keep = np.zeros(p.size, dtype=bool)
        keep[order[before < params.top_p * p.sum()]] = True
        p = np.where(keep, p, 0.0)
    return p / p.sum()


def check_finite(logits, ids, step, whose="the model's") -> None:
    """An error naming request ``ids[b]`` and ``step`` (its token's index) if logits row b is not finite."""
    bad = ~np.isfinite(logits).reshape(len(ids), -1).all(axis=1)
    if bad.any():
        raise FloatingPointError(f"request {ids[int(bad.argmax())]}, step {step}: {whose} logits hold NaN or "
                                 "inf, so no token can be chosen; are the weights finite?")


def sample(logits, params: SamplingParams, rngs, ids=None, step=0) -> list:
    """One token per row of logits (B, V), row b drawn with ``rngs[b]``; a row with NaN or inf is an
    error naming its request (``ids[b]``, default b) and ``step`` (``check_finite``)."""
    logits = np.asarray(logits)
    check_finite(logits, range(len(logits)) if ids is None else ids, step)
    if params.temperature == 0.0:
        return [int(t) for t in logits.argmax(axis=-1)]
    return [int(rng.choice(logits.shape[-1], p=filter_probs(row, params))) for row, rng in zip(logits, rngs)]
