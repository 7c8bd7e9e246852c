"""The graders' input-ownership check (``minidist.grading.untouched``) on its own: each way a student's
function can change what the caller still owns -- an element, a dtype, a list's length, a dict's key,
a list element swapped for another object, a nested array -- is named with its path; NaN that stays NaN,
and a fresh result, are not changes."""

import numpy as np
import pytest

from minidist.autograd.tensor import Tensor
from minidist.grading import untouched


def _set(i, v):
    def fn(xs):
        xs[i] = v
    return fn


def _retype(xs):
    xs[0] = xs[0].astype(np.float32)  # the same values, another dtype


def _rekey(d):
    d["b"] = d.pop("a")  # as many keys, another name


def _nested(d):
    d["blocks"][1][0] += 1.0


def _grow(xs):
    xs.append(0)


def _add_one(x):
    x += 1


def _swap_object(xs):
    xs[0] = object()


# (function, its argument, the message it must raise), by hand
CHANGES = [
    (_add_one, np.zeros(3), r"changed its input x: x\[0\] was 0, is now 1"),
    (_set(1, 7), [1, 2, 3], r"changed its input xs\[1\]: xs\[1\] was 2, is now 7"),
    (_retype, [np.zeros(2)], r"xs\[0\] was \(2,\) float64, is now \(2,\) float32"),
    (_grow, [1, 2], r"xs was \[1, 2\], is now \[1, 2, 0\]"),
    (_rekey, {"a": 1}, r"d was \{'a': 1\}, is now \{'b': 1\}"),
    (_nested, {"blocks": [np.zeros(2), np.zeros((2, 2))]}, r"d\['blocks'\]\[1\]\[0, 0\] was 0, is now 1"),
    (_set(0, 2.5), [np.float64(2.0)], r"xs\[0\] was np.float64\(2.0\), is now 2.5"),
    (_set(0, 1), [True], r"xs\[0\] was True, is now 1"),  # 1 == True, but another type
    (_swap_object, [None], r"xs\[0\] was None, is now <object"),
]


@pytest.mark.parametrize("fn, arg, says", CHANGES)
def test_each_kind_of_change_is_named_with_its_path(fn, arg, says):
    with pytest.raises(AssertionError, match=says):
        untouched(fn)(arg)


def test_a_tensor_argument_is_checked_through_its_data():
    def scale(t):
        t.data *= 2

    with pytest.raises(AssertionError, match=r"t.data\[0\] was 1, is now 2"):
        untouched(scale)(Tensor(np.ones(2)))


def test_nan_kept_a_copy_written_and_an_unsnapshotted_object_left_alone_pass():
    x = np.array([np.nan, 1.0])

    def pure(x, d, obj):
        y = x.copy()
        y[1] = 5
        return y, dict(d, c=3), obj

    y, d, _ = untouched(pure)(x, {"a": [1, np.ones(1)]}, object())
    assert y[1] == 5 and d["c"] == 3 and np.isnan(x[0]) and x[1] == 1.0


def test_an_argument_the_spec_says_is_written_may_change_but_the_others_may_not():
    def fill(cache, x, out):
        cache[0] = 1.0
        out[0] = 1.0

    untouched(fill, writes=("cache", "out"))(np.zeros(2), np.ones(2), np.zeros(2))
    with pytest.raises(AssertionError, match="changed its input out"):
        untouched(fill, writes=("cache",))(np.zeros(2), np.ones(2), np.zeros(2))
