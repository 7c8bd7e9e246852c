"""Grader for exercises/zero.py: shard bounds, a ZeRO-2 step, a ZeRO-3 forward with prefetch.

On 1..4 thread ranks: the ZeRO-2 step must equal the serial mean-gradient SGD step and send one
reduce-scatter and one all-gather (the ledger's calls); the ZeRO-3 forward must equal the serial
forward, and its log of gathers, waits, layers and releases must show the prefetch and at most two
units gathered at once.
"""

import types

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minidist.comm import all_gather, all_gather_async, all_reduce, measure, reduce_scatter, split_sizes
from minidist.grading import assert_close, no_hang, run_guarded, untouched

GRADE = settings(max_examples=12, deadline=None, derandomize=True, database=None, report_multiple_bugs=False)
WAIT_S = 10


def check_shard_bounds(impl):
    @GRADE
    @given(numel=st.integers(0, 50), world=st.integers(1, 8))
    @example(numel=10, world=4)  # 3, 3, 2, 2
    def prop(numel, world):
        parts = np.array_split(np.arange(numel), world)
        for r in range(world):
            want = (int(parts[r][0]), int(parts[r][-1]) + 1) if len(parts[r]) else None
            got = tuple(int(v) for v in impl.shard_bounds(numel, r, world))
            call = f"shard_bounds({numel}, rank {r}, world {world}) = {got}"
            if want is None:
                assert got[0] == got[1], f"{call}: rank {r} owns nothing (lo == hi)"
            else:
                assert got == want, f"{call}, expected {want} (array_split sizes {[len(q) for q in parts]})"
    prop()


def check_zero2_sgd_step(impl):
    @GRADE
    @given(p=st.integers(1, 4), n=st.integers(1, 13), seed=st.integers(0, 9))
    @example(p=3, n=7, seed=0)
    def prop(p, n, seed):
        rng = np.random.default_rng(seed)
        params, grads, lr = rng.standard_normal(n), rng.standard_normal((p, n)), 0.1
        want = params - lr * grads.sum(axis=0) / p

        def body(c):
            with measure(c) as m:
                out = untouched(impl.zero2_sgd_step)(c, params.copy(), grads[c.rank].copy(), lr)
            return out, [call.name for call in m.calls]
        for r, (got, calls) in enumerate(run_guarded(body, p, WAIT_S)):
            what = f"rank {r} of {p}, N={n} float64"
            assert_close(got, want, f"{what}: new params (params - lr * mean gradient)",
                         rtol=1e-12, atol=1e-14)
            if p > 1:
                assert sorted(calls) == ["all_gather", "reduce_scatter"], (
                    f"{what}: collectives {calls}; ZeRO-2 makes one reduce_scatter and one all_gather")
    no_hang(prop)


class Units:
    """The grader's units: rank r holds its slice of each (d, d) weight; logs every call."""

    def __init__(self, comm, weights):
        self.comm, self.n, self.d = comm, len(weights), weights[0].shape[0]
        sizes = split_sizes(self.d * self.d, comm.size)
        lo = sum(sizes[:comm.rank])
        self.sizes = sizes
        self.shards = [w.reshape(-1)[lo:lo + sizes[comm.rank]].copy() for w in weights]
        self.log, self.gathered = [], set()

    def start_gather(self, u):
        if not 0 <= u < self.n:
            raise AssertionError(f"rank {self.comm.rank}: start_gather({u}) with units 0..{self.n - 1}")
        self.log.append(("start", u))
        self.gathered.add(u)
        self.log.append(("held", len(self.gathered)))
        h = all_gather_async(self.comm, self.shards[u], sizes=self.sizes)
        units = self

        class _H:
            def wait(self):
                units.log.append(("wait", u))
                return h.wait().reshape(units.d, units.d)
        return _H()

    def layer(self, u, w, x):
        self.log.append(("layer", u))
        return np.tanh(x @ w)

    def release(self, u):
        self.log.append(("release", u))
        self.gathered.discard(u)


def _check_log(log, n, what):
    """The rules of the spec, read from one rank's log."""
    ev = [e for e in log if e[0] != "held"]
    starts = [u for k, u in ev if k == "start"]
    assert sorted(starts) == list(range(n)), f"{what}: gathers started {starts}; each unit exactly once"
    pos = {(k, u): i for i, (k, u) in enumerate(ev) if k != "held"}
    for u in range(n):
        assert ("layer", u) in pos, f"{what}: layer({u}) never ran"
        assert ("wait", u) in pos and pos[("wait", u)] < pos[("layer", u)], \
            f"{what}: layer({u}) ran before its gather's wait() returned the weight"
        assert ("release", u) in pos and pos[("release", u)] > pos[("layer", u)], \
            f"{what}: unit {u} never released after its layer (log {ev})"
        if u + 1 < n:
            assert pos[("start", u + 1)] < pos[("layer", u)], (
                f"{what}: unit {u + 1}'s gather started after layer({u}) ran: no prefetch, its bytes do not "
                f"overlap unit {u}'s compute (log {ev})")
    most = max((k for name, k in log if name == "held"), default=0)
    assert most <= 2, f"{what}: {most} units gathered at once; at most 2 (release u before starting u+2)"


def check_zero3_forward(impl):
    @GRADE
    @given(p=st.integers(1, 4), n=st.integers(1, 4), d=st.integers(1, 4), seed=st.integers(0, 9))
    @example(p=2, n=3, d=2, seed=0)
    def prop(p, n, d, seed):
        rng = np.random.default_rng(seed)
        weights = [rng.standard_normal((d, d)) for _ in range(n)]
        x0 = rng.standard_normal((2, d))
        want = x0
        for w in weights:
            want = np.tanh(want @ w)

        def body(c):
            units = Units(c, weights)
            return untouched(impl.zero3_forward)(units, x0.copy()), units.log
        for r, (got, log) in enumerate(run_guarded(body, p, WAIT_S)):
            what = f"rank {r} of {p}, {n} units of ({d}, {d}) float64"
            assert_close(got, want, f"{what}: output", rtol=1e-12, atol=1e-14)
            _check_log(log, n, what)
    no_hang(prop)


CHECKS = {"shard_bounds": check_shard_bounds, "zero2_sgd_step": check_zero2_sgd_step,
          "zero3_forward": check_zero3_forward}
POINTS = {"shard_bounds": 1, "zero2_sgd_step": 3, "zero3_forward": 4}


# -- minidist's own answer (must pass): the convention of minidist/parallel/data/zero.py ----------------

def _bounds(numel, rank, world):
    q, extra = divmod(numel, world)
    lo = rank * q + min(rank, extra)
    return lo, lo + q + (rank < extra)


def _zero2(comm, params, grad, lr, mean=True):
    lo, hi = _bounds(params.size, comm.rank, comm.size)
    mine = reduce_scatter(comm, grad) / (comm.size if mean else 1)
    new = params[lo:hi] - lr * mine
    return all_gather(comm, new, sizes=split_sizes(params.size, comm.size))


def _zero3(units, x):
    handles = {0: units.start_gather(0)} if units.n else {}
    for u in range(units.n):
        if u + 1 < units.n:
            handles[u + 1] = units.start_gather(u + 1)  # prefetch: its bytes travel while u computes
        x = units.layer(u, handles.pop(u).wait(), x)
        units.release(u)
    return x


def reference():
    return types.SimpleNamespace(shard_bounds=_bounds, zero2_sgd_step=_zero2, zero3_forward=_zero3)


# -- deliberately broken implementations (must fail) -----------------------------------------------

def _bounds_ceil(numel, rank, world):  # equal chunks of ceil(N/p): the last rank's slice is wrong
    c = -(-numel // world)
    return min(rank * c, numel), min((rank + 1) * c, numel)


def _bounds_extra_last(numel, rank, world):  # the remainder goes to the last ranks
    q, extra = divmod(numel, world)
    lo = rank * q + max(0, rank - (world - extra))
    return lo, lo + q + (rank >= world - extra)


def _zero2_sum(comm, params, grad, lr):  # forgets to divide by the world size
    return _zero2(comm, params, grad, lr, mean=False)


def _zero2_all_reduce(comm, params, grad, lr):  # right numbers, DP's all-reduce: no sharding at all
    return params - lr * all_reduce(comm, grad) / comm.size


def _zero3_no_prefetch(units, x):
    for u in range(units.n):
        x = units.layer(u, units.start_gather(u).wait(), x)
        units.release(u)
    return x


def _zero3_gather_all_first(units, x):  # all units held at once: that is DP's memory, not ZeRO-3's
    hs = [units.start_gather(u) for u in range(units.n)]
    for u in range(units.n):
        x = units.layer(u, hs[u].wait(), x)
        units.release(u)
    return x


def _zero3_never_release(units, x):
    handles = {0: units.start_gather(0)} if units.n else {}
    for u in range(units.n):
        if u + 1 < units.n:
            handles[u + 1] = units.start_gather(u + 1)
        x = units.layer(u, handles.pop(u).wait(), x)
    return x


def _zero2_slice_in_place(comm, params, grad, lr):  # right result, but `params[lo:hi] -= ...` writes into
    lo, hi = _bounds(params.size, comm.rank, comm.size)  # the caller's params
    params[lo:hi] -= lr * reduce_scatter(comm, grad) / comm.size
    return all_gather(comm, params[lo:hi], sizes=split_sizes(params.size, comm.size))


BROKEN = {"shard_bounds": [_bounds_ceil, _bounds_extra_last],
          "zero2_sgd_step": [_zero2_sum, _zero2_all_reduce, _zero2_slice_in_place],
          "zero3_forward": [_zero3_no_prefetch, _zero3_gather_all_first, _zero3_never_release]}
