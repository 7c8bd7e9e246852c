"""Shared by the load-balancing tests: small GPT configs, random batches, the per-rank virtual clock,
and brute-force searches (every split of a batch, every contiguous cut of layers) that expected
values come from."""

import itertools
import math
import threading
from pathlib import Path

import numpy as np

from minidist.nn import GPTConfig

ROOT = Path(__file__).resolve().parents[3]
CFG = GPTConfig(vocab_size=16, block_size=4, n_layer=2, n_head=2, d_model=8, dtype="float64")
TOL = 1e-9  # float64; only the summation order differs from the serial twin


def make_batches(rows, steps, seed=0, vocab=16, seq=4):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, vocab, (rows, seq)), rng.integers(0, vocab, (rows, seq))) for _ in range(steps)]


class VirtualClock:
    """perf_counter and sleep of a clock that only sleeps move: real compute takes no time on it, so
    emulated times are exact whatever the machine's load. One clock per thread: each rank of the
    threads transport is its own device, whose sleeps do not pass time on the others."""

    def __init__(self):
        self._local = threading.local()

    def perf_counter(self):
        return getattr(self._local, "now", 0.0)

    def sleep(self, seconds):
        assert seconds >= 0, seconds
        self._local.now = self.perf_counter() + seconds


def virtual_clock(monkeypatch, *modules):
    """Install one ``VirtualClock`` as ``time`` in each of ``modules`` (and the stragglers module)."""
    import minidist.resilience.stragglers

    clock = VirtualClock()
    for module in (minidist.resilience.stragglers, *modules):
        monkeypatch.setattr(module, "time", clock)
    return clock


PCFG = GPTConfig(vocab_size=16, block_size=4, n_layer=4, n_head=2, d_model=8, dtype="float64")


def best_split_time(total, speeds, minimum):
    """Brute force: the smallest max_i n_i / s_i over every split of ``total`` with n_i >= minimum."""
    best = math.inf
    for n in itertools.product(range(minimum, total + 1), repeat=len(speeds)):
        if sum(n) == total:
            best = min(best, max(k / s for k, s in zip(n, speeds)))
    return best


def best_cut(costs, p, memory=None, cap=None):
    """Smallest max-stage cost over every way to cut ``costs`` into p non-empty contiguous parts."""
    n, best = len(costs), math.inf
    for cuts in itertools.combinations(range(1, n), p - 1):
        edges = [0, *cuts, n]
        parts = list(zip(edges[:-1], edges[1:]))
        if memory is not None and any(sum(memory[a:b]) > cap for a, b in parts):
            continue
        best = min(best, max(sum(costs[a:b]) for a, b in parts))
    return best
