"""The compute copy of mixed precision (``minidist.parallel.memory.autocast``): bf16 rounding against
ml_dtypes' and by hand (round half to even)."""

import ml_dtypes
import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from minidist.parallel.memory.autocast import round_to_bf16


@given(hnp.arrays(np.float32, st.integers(1, 64), elements=st.floats(width=32, allow_nan=True)))
def test_bf16_rounding_matches_ml_dtypes(x):
    ours, ref = round_to_bf16(x), x.astype(ml_dtypes.bfloat16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(np.isnan(ours.astype(np.float32)), nan)
    np.testing.assert_array_equal(ours.view(np.uint16)[~nan], ref.view(np.uint16)[~nan])


def test_bf16_rounds_halfway_to_even():
    # 1 + 2^-8 is exactly halfway between bf16 neighbours 1 and 1 + 2^-7: goes to the even one, 1.
    x = np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8], dtype=np.float32)
    np.testing.assert_array_equal(round_to_bf16(x).astype(np.float32), [1.0, 1 + 2 * 2 ** -7])
