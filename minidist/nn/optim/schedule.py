"""The learning-rate schedule: a linear warmup, then a cosine down to a floor."""

from __future__ import annotations

import math

from minidist.nn.optim.optimizer import check_hyper


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Learning-rate multiplier: linear warmup to 1 over ``warmup`` steps, cosine down to ``min_ratio``."""
    if step < warmup:
        return (step + 1) / warmup
    if step >= total:
        return min_ratio
    progress = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class WarmupCosine:
    """Sets ``optimizer.lr`` from ``base_lr`` and :func:`warmup_cosine` at every ``step()``."""

    def __init__(self, optimizer, warmup: int, total: int, min_ratio: float = 0.1):
        if int(warmup) != warmup or warmup < 0 or int(total) != total or total < 1:
            raise ValueError(f"WarmupCosine: need integers warmup >= 0 and total >= 1, got warmup={warmup}, "
                             f"total={total}")
        check_hyper("WarmupCosine", "min_ratio", min_ratio, low=0.0, high=1.0 + 1e-12)
        self.opt, self.base_lr = optimizer, optimizer.lr
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio
        self.last = 0
        self.opt.lr = self.base_lr * warmup_cosine(0, warmup, total, min_ratio)

    def step(self):
        self.last += 1
        self.opt.lr = self.base_lr * warmup_cosine(self.last, self.warmup, self.total, self.min_ratio)

    def state_dict(self):
        return {"last": self.last, "base_lr": self.base_lr}

    def load_state_dict(self, sd):
        self.last, self.base_lr = sd["last"], sd["base_lr"]
        self.opt.lr = self.base_lr * warmup_cosine(self.last, self.warmup, self.total, self.min_ratio)
