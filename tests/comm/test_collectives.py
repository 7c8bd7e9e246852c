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
ALGOS = ["ring", "recursive_doubling", "halving_doubling", "two_shot", "tree", "naive", "mpi", "auto"]


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


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("algo", ALGOS)
@settings(max_examples=5, deadline=None, derandomize=True)
@given(shape=shapes, dtype=st.sampled_from(DTYPES), op=st.sampled_from(["sum", "mean", "max", "min"]),
       seed=st.integers(0, 99))
def test_all_reduce_equals_numpy(algo, p, shape, dtype, op, seed):
    """Every algorithm at every p = 1..8 (the folds of p = 3, 5, 6, 7 included), a few inputs each."""
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
    # the same, header-free: every rank knows the parts' lengths (np.array_split's)
    sizes = [piece.shape[axis] for piece in rs]
    known = run(lambda comm: all_gather(comm, rs[comm.rank], axis=axis, sizes=sizes), ranks=p)
    for r in range(p):
        assert_close(known[r], np.concatenate(rs, axis=axis))


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


@FAST
@given(p=st.integers(1, 8), shape=st.lists(st.integers(0, 5), min_size=1, max_size=3).map(tuple),
       dtype=st.sampled_from(DTYPES + ["float16", "bfloat16"]), seed=st.integers(0, 99), data=st.data())
def test_all_gather_equal_parts_without_headers(p, shape, dtype, seed, data):
    import ml_dtypes

    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    dt = np.dtype(getattr(ml_dtypes, dtype) if dtype == "bfloat16" else dtype)
    xs = [x.astype(dt) for x in inputs(p, shape, "float32", seed)]
    out = run(lambda comm: all_gather(comm, xs[comm.rank], axis=axis, sizes="equal"), ranks=p)
    for got in out:
        assert got.dtype == dt
        np.testing.assert_array_equal(got.view(np.uint8), np.concatenate(xs, axis=axis).view(np.uint8))


def test_all_gather_bad_sizes_raise_naming_the_rank():
    with pytest.raises(ValueError, match=r"rank 1: all_gather sizes=\[2, 2\] must list 2 lengths along "
                                         r"axis 0, with entry 1 = this rank's 3"):
        run(lambda comm: all_gather(comm, np.ones(2 + comm.rank), sizes=[2, 2]), ranks=2)
    with pytest.raises(ValueError, match="sizes='same'; use None, 'equal' or a list"):
        run(lambda comm: all_gather(comm, np.ones(2), sizes="same"), ranks=2)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("algo", [a for a in ALGOS if a not in ("mpi", "auto")])
def test_mean_works_for_half_precision(dtype, algo):
    """ml_dtypes' bfloat16 is not an np.floating subtype, yet a float: op='mean' must accept it."""
    import ml_dtypes

    dt = np.dtype(getattr(ml_dtypes, dtype) if dtype == "bfloat16" else dtype)
    p = 4
    xs = [np.arange(10, dtype=np.float32).astype(dt) * (r + 1) for r in range(p)]
    out = run(lambda comm: all_reduce(comm, xs[comm.rank], op="mean", algorithm=algo), ranks=p)
    for got in out:
        assert got.dtype == dt
        np.testing.assert_allclose(got.astype(np.float32), np.arange(10) * 2.5, rtol=1e-2)
    rs = run(lambda comm: reduce_scatter(comm, xs[comm.rank], op="mean"), ranks=p)
    np.testing.assert_allclose(np.concatenate(rs).astype(np.float32), np.arange(10) * 2.5, rtol=1e-2)


def test_mean_still_rejects_integers_and_integer_like_ml_dtypes():
    import ml_dtypes

    for dt in (np.int32, ml_dtypes.int4):
        with pytest.raises(TypeError, match="rank 0: op='mean' needs a floating dtype"):
            run(lambda comm, dt=dt: all_reduce(comm, np.ones(4, dt), op="mean"), ranks=1)
