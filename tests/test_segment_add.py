"""The deterministic scatter-add (minidist/segment_add.py): its positions and segments reproduce
NumPy's ``add.at`` bit for bit (checked on NumPy with the kernel's loop written in Python), and on a
GPU the kernel itself does, the same every run."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist.segment_add import flat_positions, segments


def add_in_segments(target, index, values):
    """What the CuPy kernel does, one segment at a time, in Python."""
    lin = flat_positions(np, target.shape, index)
    vals = np.broadcast_to(np.asarray(values, dtype=target.dtype), lin.shape).reshape(-1)
    lin = lin.reshape(-1)
    flat = target.reshape(-1)
    if lin.size:
        order, starts, stops = segments(np, lin)
        for a, b in zip(starts, stops):
            at = lin[order[a]]
            acc = flat[at]
            for j in order[a:b]:
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


def test_order_matters_so_the_reference_is_not_trivial():
    """Summed in another order, these float32 values give other bits: the test above can fail."""
    v = np.array([1e8, 1.0, -1e8, 1.0], np.float32)
    forward, backward = np.float32(0), np.float32(0)
    for x in v:
        forward = forward + x
    for x in v[::-1]:
        backward = backward + x
    assert forward != backward


@pytest.mark.gpu
def test_cupy_scatter_add_equals_numpy_bit_for_bit_every_run():
    cupy = pytest.importorskip("cupy")
    from minidist.segment_add import cupy_scatter_add

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
