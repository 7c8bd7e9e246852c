"""The deterministic scatter-add (minidist/accel/segment_add.py): its positions and segments reproduce
NumPy's ``add.at`` bit for bit (checked on NumPy with the kernel's loop written in Python), and on a
GPU the kernel itself does, the same every run."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist.accel.segment_add import flat_positions, segments


def add_in_segments(target, index, values, reverse=False):
    """What the CuPy kernel does, one segment at a time, in Python (``reverse``: each segment
    backwards, a wrong order the tests must be able to tell apart)."""
    lin = flat_positions(np, target.shape, index)
    vals = np.broadcast_to(np.asarray(values, dtype=target.dtype), lin.shape).reshape(-1)
    lin = lin.reshape(-1)
    flat = target.reshape(-1)
    if lin.size:
        order, starts, stops = segments(np, lin)
        for a, b in zip(starts, stops):
            at = lin[order[a]]
            acc = flat[at]
            for j in (order[a:b][::-1] if reverse else order[a:b]):
                acc = acc + vals[j]
            flat[at] = acc
    return target


INDEXES = [
    lambda rng, shape: rng.integers(-shape[0], shape[0], 40),                       # repeated rows, negative
    lambda rng, shape: (rng.integers(0, shape[0], 30), rng.integers(0, shape[1], 30)),  # (rows, cols) pairs
    lambda rng, shape: (slice(1, None), rng.integers(0, shape[1], 7)),              # a slice and an array
    lambda rng, shape: (rng.integers(0, shape[0], (3, 4)),),                        # a 2-D index array
]


@given(seed=st.integers(0, 2**16), which=st.integers(0, len(INDEXES) - 1),
       dtype=st.sampled_from(["float32", "float64"]))
def test_segments_add_in_numpys_order(seed, which, dtype):
    rng = np.random.default_rng(seed)
    shape = (5, 6)
    index = INDEXES[which](rng, shape)
    start = rng.standard_normal(shape).astype(dtype)
    scale = 10.0 ** rng.integers(-6, 6, start[index].shape)  # wide magnitudes: the order shows in the bits
    values = (rng.standard_normal(start[index].shape) * scale).astype(dtype)
    want = start.copy()
    np.add.at(want, index, values)
    got = add_in_segments(start.copy(), index, values)
    assert got.tobytes() == want.tobytes()


def test_flat_embedding_positions_and_segments_by_hand():
    lin = flat_positions(np, (10,), np.array([3, -1, 3, 0, 9, 3]))
    assert lin.tolist() == [3, 9, 3, 0, 9, 3]
    order, starts, stops = segments(np, lin)
    assert order.tolist() == [3, 0, 2, 5, 1, 4]  # position 0; then 3 three times in index order; then 9
    assert starts.tolist() == [0, 1, 4] and stops.tolist() == [1, 4, 6]


def test_a_wrong_order_gives_other_bits_so_the_property_test_can_fail():
    """The same segments added backwards differ from ``np.add.at`` on wide magnitudes: bit
    equality with NumPy really pins the order."""
    index = np.array([0, 0, 0, 0, 1])
    values = np.array([1e8, 1.0, -1e8, 1.0, 2.0], np.float32)
    want = np.zeros(2, np.float32)
    np.add.at(want, index, values)
    assert add_in_segments(np.zeros(2, np.float32), index, values).tobytes() == want.tobytes()
    assert add_in_segments(np.zeros(2, np.float32), index, values, reverse=True).tobytes() != want.tobytes()


@pytest.mark.gpu
def test_cupy_scatter_add_equals_numpy_bit_for_bit_every_run():
    cupy = pytest.importorskip("cupy")
    from minidist.accel.segment_add import cupy_scatter_add

    rng = np.random.default_rng(0)
    for index in (rng.integers(0, 50, 5000), (rng.integers(0, 50, 4000), rng.integers(0, 8, 4000))):
        shape = (50,) if not isinstance(index, tuple) else (50, 8)
        values = rng.standard_normal(np.zeros(shape)[index].shape).astype(np.float32)
        want = np.zeros(shape, np.float32)
        np.add.at(want, index, values)
        gpu_index = tuple(cupy.asarray(i) for i in index) if isinstance(index, tuple) else cupy.asarray(index)
        runs = [cupy_scatter_add(cupy.zeros(shape, cupy.float32), gpu_index, cupy.asarray(values))
                for _ in range(3)]
        for got in runs:
            assert cupy.asnumpy(got).tobytes() == want.tobytes()


def _integer_ids(rng, shape):
    """One id per axis: arrays (some 2-D, broadcasting), plain ints, negatives -- all in range."""
    ids = []
    for n in shape:
        kind = rng.integers(0, 3)
        if kind == 0:
            ids.append(int(rng.integers(-n, n)))
        else:
            dtype = rng.choice(["int32", "int64"])
            ids.append(rng.integers(-n, n, (4,) if kind == 1 else (3, 1)).astype(dtype))
    return tuple(ids)


@given(seed=st.integers(0, 2**16), ndim=st.integers(1, 3))
def test_integer_ids_on_every_axis_ravel_like_numpy_indexing(seed, ndim):
    """The direct path (rows*ncols + cols) against NumPy's own indexing of a table of positions,
    and the segment adds against ``np.add.at``."""
    rng = np.random.default_rng(seed)
    shape = tuple(int(n) for n in rng.integers(1, 6, ndim))
    index = _integer_ids(rng, shape)
    table = np.arange(int(np.prod(shape))).reshape(shape)
    assert np.array_equal(flat_positions(np, shape, index), table[index])
    start = rng.standard_normal(shape)
    values = rng.standard_normal(np.shape(table[index])) * 10.0 ** rng.integers(-6, 6, np.shape(table[index]))
    want = start.copy()
    np.add.at(want, index, values)
    assert add_in_segments(start.copy(), index, values).tobytes() == want.tobytes()


def test_cross_entropys_index_builds_no_table_the_size_of_the_target():
    """(arange(B), t) over (B, V) logits: no arange of B*V positions, only the B ids themselves."""
    sizes = []

    class Recording:
        def __getattr__(self, name):
            return getattr(np, name)

        def arange(self, n, *a, **k):
            sizes.append(n)
            return np.arange(n, *a, **k)

    rows, t = np.arange(4), np.array([7, 0, 999, 3])
    got = flat_positions(Recording(), (4, 1000), (rows, t))
    assert got.tolist() == [7, 1000, 2999, 3003]
    assert all(n < 1000 for n in sizes), sizes
    sizes.clear()  # MoE's row scatter: whole rows 3, 0, 3 of a (5, 4) target, positions by hand
    got = flat_positions(Recording(), (5, 4), np.array([3, 0, 3]))
    assert got.tolist() == [[12, 13, 14, 15], [0, 1, 2, 3], [12, 13, 14, 15]]
    assert all(n <= 4 for n in sizes), sizes


@pytest.mark.parametrize("shape, index, axis, bad", [
    ((5, 6), (np.array([0, 1]), np.array([2, 6])), 1, 6),
    ((5, 6), (np.array([0, -6]), np.array([2, 1])), 0, -6),
    ((10,), np.array([3, 10, 2]), 0, 10),
    ((2, 3, 4), (1, np.array([0, 2]), np.array([-5])), 2, -5),
])
def test_out_of_range_ids_raise_naming_the_axis_and_its_size(shape, index, axis, bad):
    message = f"index {bad} is out of bounds for axis {axis} with size {shape[axis]}"
    with pytest.raises(IndexError, match=message):
        np.add.at(np.zeros(shape), index, 1.0)  # the behaviour to match
    with pytest.raises(IndexError, match=message):
        flat_positions(np, shape, index)
