"""Grader for exercises/offload.py: shards by bytes, and a momentum step whose state lives on disk.

``make_shards`` is compared with the rule written out here; ``offloaded_momentum_step`` runs
against a ``DiskStore`` (a temporary directory of .npy files, loads on a background thread) and must
equal momentum SGD kept in memory, with a log of loads and saves that shows the prefetch.
"""

import tempfile
import threading
import types
from pathlib import Path

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minidist.grading import assert_close, untouched
from minidist.parallel.memory.offload import make_shards as library_make_shards

GRADE = settings(max_examples=12, deadline=None, derandomize=True, database=None, report_multiple_bugs=False)


def _expected_shards(nbytes, limit):
    out = []
    for i, b in enumerate(nbytes):
        if not out or sum(nbytes[j] for j in out[-1]) + b > limit:
            out.append([])
        out[-1].append(i)
    return out


def check_make_shards(impl):
    @GRADE
    @given(nbytes=st.lists(st.integers(1, 20), max_size=10), limit=st.integers(1, 30))
    @example(nbytes=[4, 4, 4, 10, 1], limit=8)
    def prop(nbytes, limit):
        got, want = untouched(impl.make_shards)(list(nbytes), limit), _expected_shards(nbytes, limit)
        got = [list(s) for s in got]
        assert got == want, f"make_shards({nbytes}, shard_bytes={limit}) = {got}, expected {want}"
    prop()


class DiskStore:
    """Momentum shards as .npy files; ``load_async`` reads on a thread; every call is logged."""

    def __init__(self, directory, shards, momenta):
        self.dir, self.shards, self.log, self.held = Path(directory), shards, [], set()
        for s, idx in enumerate(shards):
            for i in idx:
                np.save(self.dir / f"m{s}_{i}.npy", momenta[i])

    def load_async(self, s):
        self.log.append(("load", s))
        self.held.add(s)
        self.log.append(("held", len(self.held)))
        out, done = {}, threading.Event()

        def read():
            out["m"] = [np.load(self.dir / f"m{s}_{i}.npy") for i in self.shards[s]]
            done.set()
        threading.Thread(target=read, daemon=True).start()
        store = self

        class _H:
            def wait(self):
                done.wait(10)
                store.log.append(("wait", s))
                return out["m"]
        return _H()

    def save(self, s, arrays):
        self.log.append(("save", s))
        arrays = list(arrays)
        if len(arrays) != len(self.shards[s]):
            raise AssertionError(f"save({s}, ...) got {len(arrays)} arrays; shard {s} has "
                                 f"{len(self.shards[s])} parameters {self.shards[s]}")
        for i, a in zip(self.shards[s], arrays):
            np.save(self.dir / f"m{s}_{i}.npy", np.asarray(a))
        self.held.discard(s)

    def read(self, i):
        s = next(k for k, idx in enumerate(self.shards) if i in idx)
        return np.load(self.dir / f"m{s}_{i}.npy")


def _check_log(log, n, what):
    ev = [e for e in log if e[0] != "held"]
    for kind in ("load", "save"):
        got = sorted(s for k, s in ev if k == kind)
        assert got == list(range(n)), f"{what}: {kind}s of shards {got}; each of the {n} shards exactly once"
    pos = {e: i for i, e in enumerate(ev)}
    for s in range(n - 1):
        assert pos[("load", s + 1)] < pos[("save", s)], (
            f"{what}: shard {s + 1}'s load started after shard {s} was saved: no prefetch, the step waits "
            f"for the disk at every shard (log {ev})")
    most = max((k for name, k in log if name == "held"), default=0)
    assert most <= 2, f"{what}: {most} shards in memory at once; at most 2 (save s before loading s+2)"


def check_offloaded_momentum_step(impl):
    @GRADE
    @given(sizes=st.lists(st.integers(1, 5), min_size=1, max_size=6), limit=st.integers(8, 48),
           steps=st.integers(1, 2), seed=st.integers(0, 9))
    @example(sizes=[3, 3, 3, 3], limit=24, steps=2, seed=0)
    def prop(sizes, limit, steps, seed):
        rng = np.random.default_rng(seed)
        params = [rng.standard_normal(k) for k in sizes]
        shards = _expected_shards([8 * k for k in sizes], limit)
        lr, beta = 0.1, 0.9
        want_p, want_m = [p.copy() for p in params], [np.zeros(k) for k in sizes]
        what = f"{len(sizes)} float64 parameters of sizes {sizes}, shards {shards}"
        with tempfile.TemporaryDirectory() as d:
            store = DiskStore(d, shards, want_m)
            for step in range(steps):
                grads = [rng.standard_normal(k) for k in sizes]
                for i, g in enumerate(grads):
                    want_m[i] = beta * want_m[i] + g
                    want_p[i] = want_p[i] - lr * want_m[i]
                store.log.clear()
                step = untouched(impl.offloaded_momentum_step, ["store", "params", "grads", "lr", "beta"],
                                 writes=("params",))  # the spec: params are updated in place
                step(store, params, [g.copy() for g in grads], lr, beta)
                for i in range(len(sizes)):
                    assert_close(params[i], want_p[i], f"{what}, step {step}: parameter {i} (p -= lr * m)",
                                 rtol=1e-12, atol=1e-14)
                    assert_close(store.read(i), want_m[i], f"{what}, step {step}: momentum {i} on disk "
                                 "(m = beta * m + g, saved back)", rtol=1e-12, atol=1e-14)
                _check_log(store.log, len(shards), f"{what}, step {step}")
    prop()


CHECKS = {"make_shards": check_make_shards, "offloaded_momentum_step": check_offloaded_momentum_step}
POINTS = {"make_shards": 2, "offloaded_momentum_step": 4}


# -- minidist's own answer (must pass) -------------------------------------------------------------

def _update(store, params, grads, lr, beta, s, ms):
    for i, m in zip(store.shards[s], ms):
        m = beta * m + grads[i]
        params[i] -= lr * m
        yield m


def _step(store, params, grads, lr, beta):
    n = len(store.shards)
    pending = {0: store.load_async(0)} if n else {}
    for s in range(n):
        if s + 1 < n:
            pending[s + 1] = store.load_async(s + 1)  # the disk reads s+1 while s is updated
        store.save(s, list(_update(store, params, grads, lr, beta, s, pending.pop(s).wait())))


def reference():
    return types.SimpleNamespace(make_shards=library_make_shards, offloaded_momentum_step=_step)


# -- deliberately broken implementations (must fail) -----------------------------------------------

def _shards_inclusive(nbytes, shard_bytes):  # closes a shard only once it is over the limit
    out, size = [], 0
    for i, b in enumerate(nbytes):
        if not out or size >= shard_bytes:
            out.append([])
            size = 0
        out[-1].append(i)
        size += b
    return out


def _one_per_parameter(nbytes, shard_bytes):
    return [[i] for i in range(len(nbytes))]


def _step_no_prefetch(store, params, grads, lr, beta):
    for s in range(len(store.shards)):
        store.save(s, list(_update(store, params, grads, lr, beta, s, store.load_async(s).wait())))


def _step_load_all_first(store, params, grads, lr, beta):  # all the state in memory: no offload at all
    hs = [store.load_async(s) for s in range(len(store.shards))]
    for s in range(len(store.shards)):
        store.save(s, list(_update(store, params, grads, lr, beta, s, hs[s].wait())))


def _step_momentum_not_saved(store, params, grads, lr, beta):  # updates params, loses the new state
    n = len(store.shards)
    pending = {0: store.load_async(0)} if n else {}
    for s in range(n):
        if s + 1 < n:
            pending[s + 1] = store.load_async(s + 1)
        ms = pending.pop(s).wait()
        list(_update(store, params, grads, lr, beta, s, ms))
        store.save(s, ms)


def _step_momentum_in_grads(store, params, grads, lr, beta):  # right params and momentum, but builds
    n = len(store.shards)                                       # m in the caller's grads (g += beta·m)
    pending = {0: store.load_async(0)} if n else {}
    for s in range(n):
        if s + 1 < n:
            pending[s + 1] = store.load_async(s + 1)
        for i, m in zip(store.shards[s], pending[s].wait()):
            grads[i] += beta * m
            params[i] -= lr * grads[i]
        store.save(s, [grads[i] for i in store.shards[s]])
        del pending[s]


BROKEN = {"make_shards": [_shards_inclusive, _one_per_parameter],
          "offloaded_momentum_step": [_step_no_prefetch, _step_load_all_first, _step_momentum_not_saved,
                                      _step_momentum_in_grads]}
