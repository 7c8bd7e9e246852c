"""CI for the zero grader (minidist/grading/zero.py): minidist's own answer gets full marks, every
broken version fails its task with a message, the untouched stub scores 0."""

from minidist.grading import grader_tests
from minidist.grading import zero as G

test_reference_passes, test_broken_implementation_fails, test_grade_reports_the_stub_as_not_written = \
    grader_tests("zero", G.CHECKS, G.reference, G.BROKEN)


def test_writing_into_the_callers_params_fails_naming_params():
    import types

    import pytest
    with pytest.raises(AssertionError, match=r"changed its input params"):
        G.CHECKS["zero2_sgd_step"](types.SimpleNamespace(zero2_sgd_step=G._zero2_slice_in_place))
