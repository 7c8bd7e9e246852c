"""What a tensor-parallel rank owns: a Shard's split and concat, by hand."""

import numpy as np
import pytest

from minidist.parallel.tensor.shard import Shard


def test_shard_split_and_concat_by_hand():
    a = np.arange(4 * 12).reshape(4, 12)
    np.testing.assert_array_equal(Shard(0).split(a, 1, 2), a[2:4])
    np.testing.assert_array_equal(Shard(1).split(a, 2, 3), a[:, 8:12])
    # q|k|v, each of 4 columns, over 2 ranks: rank 1 keeps columns 2-3 of q, of k and of v
    np.testing.assert_array_equal(Shard(1, blocks=3).split(a, 1, 2), a[:, [2, 3, 6, 7, 10, 11]])
    np.testing.assert_array_equal(Shard(0, blocks=3).split(a[0], 0, 2), a[0, [0, 1, 4, 5, 8, 9]])
    for shard in (Shard(0), Shard(1), Shard(1, blocks=3), Shard(-1, blocks=2)):
        np.testing.assert_array_equal(shard.concat([shard.split(a, r, 2) for r in range(2)]), a)
    with pytest.raises(ValueError, match=r"w: axis 1 of shape \(4, 12\).* does not split into 5 equal parts"):
        Shard(1).split(a, 0, 5, "w")
    with pytest.raises(ValueError, match=r"of each of its 3 blocks"):
        Shard(1, blocks=3).split(a, 0, 3)
