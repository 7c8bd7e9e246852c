"""CI for the data_parallel grader (minidist/grading/data_parallel.py): minidist's own answer gets full
marks, every broken version in its BROKEN fails its task with a message, the untouched stub scores 0."""

from minidist.grading import data_parallel as G
from minidist.grading import grader_tests

test_reference_passes, test_broken_implementation_fails, test_grade_reports_the_stub_as_not_written = \
    grader_tests("data_parallel", G.CHECKS, G.reference, G.BROKEN)


def test_writing_into_the_callers_grads_fails_naming_grads():
    import types

    import pytest
    with pytest.raises(AssertionError, match=r"changed its input grads"):
        G.CHECKS["average_gradients"](types.SimpleNamespace(average_gradients=G._weighted_in_place))
