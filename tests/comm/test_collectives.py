"""Every collective equals its NumPy definition (threads transport, p = 1..8, any shape/dtype/op)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minidist.comm import (
    all_gather,
    all_gather_async,
    all_reduce,
    all_reduce_async,
    all_to_all,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
    reduce_scatter_async,
    run,
    scatter,
)

FAST = settings(max_examples=15, deadline=None, derandomize=True)
DTYPES = ["float32", "float64", "int32", "int64"]
ALGOS = ["ring", "recursive_doubling", "halving_doubling", "tree", "naive", "mpi", "auto"]


def inputs(p, shape, dtype, seed):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(shape) * 10).astype(dtype) for _ in range(p)]


def serial(xs, op):
    stack = np.stack(xs).astype(np.float64 if op == "mean" else xs[0].dtype)
    out = {"sum": stack.sum(0), "mean": stack.mean(0), "max": stack.max(0), "min": stack.min(0)}[op]
    return out.astype(xs[0].dtype)


def assert_close(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    if np.issubdtype(got.dtype, np.floating):  # summation order differs from np.sum
        tol = 1e-4 if got.dtype == np.float32 else 1e-10
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * 100)
    else:
        np.testing.assert_array_equal(got, want)


shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)


@FAST
@given(p=st.integers(1, 8), shape=shapes, dtype=st.sampled_from(DTYPES),
       op=st.sampled_from(["sum", "mean", "max", "min"]), algo=st.sampled_from(ALGOS),
       seed=st.integers(0, 99))
def test_all_reduce_equals_numpy(p, shape, dtype, op, algo, seed):
    if op == "mean" and dtype.startswith("int"):
        dtype = "float64"
    xs = inputs(p, shape, dtype, seed)
    out = run(lambda comm: all_reduce(comm, xs[comm.rank], op=op, algorithm=algo), ranks=p)
    want = serial(xs, op).astype(dtype)
    for r in range(p):
        assert_close(out[r], want)
        np.testing.assert_array_equal(out[r], out[0])  # every rank gets the same bits


@FAST
@given(p=st.integers(1, 8), shape=st.lists(st.integers(0, 7), min_size=1, max_size=3).map(tuple),
       dtype=st.sampled_from(DTYPES), op=st.sampled_from(["sum", "max", "min"]), seed=st.integers(0, 99),
       data=st.data())
def test_reduce_scatter_and_all_gather(p, shape, dtype, op, seed, data):
    axis = data.draw(st.integers(0, len(shape) - 1))
    xs = inputs(p, shape, dtype, seed)
    rs = run(lambda comm: reduce_scatter(comm, xs[comm.rank], op=op, axis=axis), ranks=p)
    want = np.array_split(serial(xs, op), p, axis=axis)
    for r in range(p):
        assert_close(rs[r], want[r])
    # all_gather of the pieces (their sizes along `axis` differ when p doesn't divide) rebuilds it
    ag = run(lambda comm: all_gather(comm, rs[comm.rank], axis=axis), ranks=p)
    for r in range(p):
        assert_close(ag[r], np.concatenate(rs, axis=axis))


@FAST
@given(p=st.integers(1, 8), shape=shapes, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 99),
       data=st.data())
def test_broadcast_reduce_gather_scatter(p, shape, dtype, seed, data):
    root = data.draw(st.integers(0, p - 1))
    xs = inputs(p, shape, dtype, seed)

    def body(comm):
        r = comm.rank
        b_none = broadcast(comm, xs[r] if r == root else None, root=root)
        b_arr = broadcast(comm, xs[r], root=root)
        red = reduce(comm, xs[r], op="sum", root=root)
        g = gather(comm, xs[r][..., : r + 1] if xs[r].ndim else xs[r], root=root)
        sc = scatter(comm, xs if r == root else None, root=root)
        return b_none, b_arr, red, g, sc

    out = run(body, ranks=p)
    for r, (b_none, b_arr, red, g, sc) in enumerate(out):
        np.testing.assert_array_equal(b_none, xs[root])
        np.testing.assert_array_equal(b_arr, xs[root])
        assert (red is None) == (r != root)
        if r == root:
            assert_close(red, serial(xs, "sum"))
            assert len(g) == p
            for j in range(p):
                np.testing.assert_array_equal(g[j], xs[j][..., : j + 1] if xs[j].ndim else xs[j])
        else:
            assert g is None
        np.testing.assert_array_equal(sc, xs[r])


@FAST
@given(p=st.integers(1, 8), seed=st.integers(0, 99))
def test_all_to_all_is_a_transpose(p, seed):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 5, size=(p, p))
    chunks = [[np.full(sizes[i, j], 100 * i + j, np.int64) for j in range(p)] for i in range(p)]
    out = run(lambda comm: all_to_all(comm, chunks[comm.rank]), ranks=p)
    for j in range(p):
        for i in range(p):
            np.testing.assert_array_equal(out[j][i], chunks[i][j])


def test_async_collectives_overlap_and_keep_order():
    def body(comm):
        xs = [np.full(1000, comm.rank + k, np.float64) for k in range(4)]
        hs = [all_reduce_async(comm, x) for x in xs]
        g = all_gather_async(comm, np.array([comm.rank]))
        rs = reduce_scatter_async(comm, np.arange(8.0))
        blocking = all_reduce(comm, np.ones(3))  # the main thread can communicate meanwhile
        return [h.wait()[0] for h in hs], g.wait().tolist(), rs.wait().tolist(), blocking[0]

    p = 4
    for r, (sums, g, rs, b) in enumerate(run(body, ranks=p)):
        assert sums == [sum(q + k for q in range(p)) for k in range(4)]
        assert g == list(range(p))
        assert rs == (np.array_split(np.arange(8.0) * p, p)[r]).tolist()
        assert b == p


def test_bad_arguments_raise_clearly():
    with pytest.raises(ValueError, match="unknown op 'prod'"):
        run(lambda comm: all_reduce(comm, np.ones(3), op="prod"), ranks=2)
    with pytest.raises(ValueError, match="unknown algorithm"):
        run(lambda comm: all_reduce(comm, np.ones(3), algorithm="magic"), ranks=2)
    with pytest.raises(TypeError, match="floating dtype"):
        run(lambda comm: all_reduce(comm, np.ones(3, np.int32), op="mean"), ranks=2)
    with pytest.raises(ValueError, match="needs 3 chunks"):
        run(lambda comm: all_to_all(comm, [np.ones(1)]), ranks=3)


def test_jax_arrays_come_back_as_jax_on_each_ranks_device():
    jax = pytest.importorskip("jax")
    devices = jax.devices()  # 8 forced CPU devices in tests (conftest sets XLA_FLAGS)

    def body(comm):
        x = comm.backend.from_host(np.arange(4.0) + comm.rank)
        y = all_reduce(comm, x)
        z = all_gather(comm, x)
        return type(y).__module__.split(".")[0], list(y.devices()), np.asarray(y).tolist(), z.shape

    out = run(body, ranks=4, backend="jax")
    for r, (mod, devs, vals, zshape) in enumerate(out):
        assert mod in ("jax", "jaxlib") and devs == [devices[r % len(devices)]]
        assert vals == [6.0, 10.0, 14.0, 18.0] and zshape == (16,)
