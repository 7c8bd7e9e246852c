"""Shared by the load-balancing tests: small GPT configs, random batches, the per-rank virtual clock,
and brute-force searches (every split of a batch, every contiguous cut of layers) that expected
values come from."""

import itertools
import math
from pathlib import Path

import numpy as np

from minidist.nn import GPTConfig

ROOT = Path(__file__).resolve().parents[3]
CFG = GPTConfig(vocab_size=16, block_size=4, n_layer=2, n_head=2, d_model=8, dtype="float64")
TOL = 1e-9  # float64; only the summation order differs from the serial twin


def make_batches(rows, steps, seed=0, vocab=16, seq=4):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, vocab, (rows, seq)), rng.integers(0, vocab, (rows, seq))) for _ in range(steps)]


FREE = "tflops=1e12,gBps=1e12,overhead_us=0,name=free"  # a device on which the model's ops cost nothing


def virtual_clock(monkeypatch, *modules):
    """minidist's virtual clock (``MINIDIST_CLOCK=virtual``) on a device whose ops cost nothing and a
    link that costs nothing, so only the emulated times (``Slowdown``'s pace and factors) pass: exact
    whatever the machine's load. Each rank of ``run`` keeps its own clock; this test's thread reads
    one too, returned: ``perf_counter()`` its time, ``sleep(s)`` s more. (``modules``: unused.)"""
    from minidist.comm.clock import RankClock, parse_device
    from minidist.comm.transports import link
    from minidist.trace import clock as trace_clock

    monkeypatch.setenv("MINIDIST_CLOCK", "virtual")
    monkeypatch.setenv("MINIDIST_DEVICE", FREE)
    monkeypatch.setenv("MINIDIST_LINK", "alpha_us=0,gBps=1e9")
    monkeypatch.setattr(link, "_CURRENT", [])
    clock = RankClock(link.parse_link("alpha_us=0,gBps=1e9"), parse_device(FREE))
    monkeypatch.setattr(trace_clock._local, "source", clock.now, raising=False)
    monkeypatch.setattr(trace_clock._local, "advance", clock.advance, raising=False)
    clock.perf_counter, clock.sleep = clock.now, clock.advance
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
