"""Grader for exercises/data_parallel.py: DDP's gradient buckets and the weighted gradient average.

``CHECKS[task](impl)`` raises AssertionError when ``impl.<task>`` is wrong. Buckets are compared with
``minidist.parallel.data.ddp.build_buckets`` fed the parameters in reverse, as DDP does; averaged
gradients, on 1..5 thread ranks with uneven batches, with the serial mean over the global batch.
They run here against minidist's own DDP (must pass) and deliberately broken versions (must fail).
"""

import types

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minidist.comm import all_reduce
from minidist.grading import assert_close, no_hang, run_guarded, untouched
from minidist.nn import Module
from minidist.nn.module import Parameter
from minidist.parallel.data import ddp as D

GRADE = settings(max_examples=15, deadline=None, derandomize=True, database=None, report_multiple_bugs=False)
TOL = dict(rtol=1e-10, atol=1e-12)  # the ranks' partial sums add up in another order than the serial mean


WAIT_S = 10  # a rank waiting longer than this for its peers fails the task (not the 300 s default)


def _expected_buckets(sizes, bucket_bytes):
    """The spec's rule, written out here (not minidist's build_buckets): walk n-1..0, close the
    current bucket when the next parameter would take it over bucket_bytes."""
    buckets, cur, used = [], [], 0
    for i in reversed(range(len(sizes))):
        if cur and used + sizes[i] > bucket_bytes:
            buckets.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += sizes[i]
    return buckets + [cur] if cur else buckets


def check_build_buckets(impl):
    @GRADE
    @given(sizes=st.lists(st.integers(1, 16), min_size=1, max_size=8), bucket_bytes=st.integers(1, 40))
    @example(sizes=[4, 4, 4, 8], bucket_bytes=8)  # the docstring's: full buckets, tried first
    def prop(sizes, bucket_bytes):
        what = f"build_buckets({sizes}, {bucket_bytes})"
        got = untouched(impl.build_buckets)(list(sizes), bucket_bytes)
        flat = [int(i) for b in got for i in b]
        assert flat == list(reversed(range(len(sizes)))), (
            f"{what} = {got}: the buckets must hold parameters {len(sizes) - 1}..0, each once, in that order")
        want = _expected_buckets(sizes, bucket_bytes)
        assert [list(b) for b in got] == want, f"{what} = {got}, DDP makes {want}"
    prop()
    for sizes, bucket_bytes, want in [([4, 4, 4, 8], 8, [[3], [2, 1], [0]]), ([1, 2, 3], 100, [[2, 1, 0]]),
                                      ([5, 5], 4, [[1], [0]]), ([2, 2, 2], 4, [[2, 1], [0]])]:
        got = [[int(i) for i in b] for b in untouched(impl.build_buckets)(sizes, bucket_bytes)]
        assert got == want, f"build_buckets({sizes}, {bucket_bytes}) = {got}, expected {want}"


@st.composite
def global_batches(draw):
    """Per-sample gradients of a model (a list of parameter shapes) and the samples per rank."""
    counts = draw(st.lists(st.integers(0, 4), min_size=1, max_size=5).filter(lambda c: sum(c) > 0))
    shape = st.lists(st.integers(1, 3), min_size=1, max_size=2).map(tuple)
    shapes = draw(st.lists(shape, min_size=1, max_size=3))
    rng = np.random.default_rng(draw(st.integers(0, 99)))
    return counts, [rng.standard_normal((sum(counts),) + s) for s in shapes]


def _local_mean(per_sample, counts, rank):
    lo, n = sum(counts[:rank]), counts[rank]
    return [g[lo:lo + n].mean(0) if n else np.zeros(g.shape[1:]) for g in per_sample]


def check_average_gradients(impl):
    @GRADE
    @given(batch=global_batches())
    @example(batch=([1], [np.ones((1, 2))]))  # tried first: a stub fails fast, unshrunk
    def prop(batch):
        counts, per_sample = batch
        want = [g.mean(0) for g in per_sample]  # the serial twin: one mean over the global batch
        p = len(counts)
        def body(comm):
            average = untouched(impl.average_gradients)
            return average(comm, _local_mean(per_sample, counts, comm.rank), counts[comm.rank])
        out = run_guarded(body, p, WAIT_S)
        for r, got in enumerate(out):
            what = f"rank {r} of {p}, samples per rank {counts}"
            assert len(got) == len(want), f"{what}: {len(got)} gradients returned, expected {len(want)}"
            for k, (a, b) in enumerate(zip(got, want)):
                assert_close(a, b, f"{what}: gradient {k}, vs the serial mean over all {sum(counts)} samples",
                             **TOL)
    no_hang(prop)


CHECKS = {"build_buckets": check_build_buckets, "average_gradients": check_average_gradients}


# -- minidist's own implementation (must pass) ---------------------------------------------------

def _reference_buckets(sizes, bucket_bytes):
    """minidist's DDP bucketing on stand-in parameters of ``sizes`` bytes (the code being graded)."""
    params = [types.SimpleNamespace(index=i, size=n, dtype=np.uint8) for i, n in enumerate(sizes)]
    return [[p.index for p in b.params] for b in D.build_buckets(reversed(params), bucket_bytes)]


class _Constant(Module):
    """A model whose loss sum_k <p_k, g_k> has the gradients g_k: DDP then averages exactly them."""

    def __init__(self, grads):
        super().__init__()
        for k, g in enumerate(grads):
            setattr(self, f"p{k}", Parameter(np.zeros_like(g)))
        self.grads = grads

    def loss(self):
        total = None
        for p, g in zip(self.parameters(), self.grads):
            term = (p * g).sum()
            total = term if total is None else total + term
        return total


def reference():
    def average_gradients(comm, grads, n_local):
        model = _Constant(grads)
        ddp = D.DistributedDataParallel(model, comm)
        ddp.backward(model.loss(), n_samples=n_local)
        ddp.wait_gradients()
        return [np.asarray(p.grad) for p in model.parameters()]

    return types.SimpleNamespace(build_buckets=_reference_buckets, average_gradients=average_gradients)


# -- deliberately broken implementations (must fail) ---------------------------------------------

def _forward_order(sizes, bucket_bytes):  # the first layer's gradients come last in backward
    return list(reversed([list(reversed(b)) for b in _reference_buckets(sizes, bucket_bytes)]))


def _never_full(sizes, bucket_bytes):  # closes a bucket that is exactly full one parameter early
    buckets, cur, used = [], [], 0
    for i in reversed(range(len(sizes))):
        if cur and used + sizes[i] >= bucket_bytes:
            buckets.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += sizes[i]
    return buckets + [cur]


def _plain_mean(comm, grads, n_local):  # right only when every rank has as many samples
    return [all_reduce(comm, g) / comm.size for g in grads]


def _mean_of_local_means(comm, grads, n_local):  # weights by n_local but divides by p * n_local
    return [all_reduce(comm, g * n_local) / (comm.size * max(n_local, 1)) for g in grads]


def _weighted_in_place(comm, grads, n_local):  # right average, but `g *= n_local` writes into the caller's
    for g in grads:                            # gradients
        g *= n_local
    n = float(all_reduce(comm, np.array(float(n_local))))
    return [all_reduce(comm, g) / n for g in grads]


BROKEN = {"build_buckets": [_forward_order, _never_full],
          "average_gradients": [_plain_mean, _mean_of_local_means, _weighted_in_place]}
