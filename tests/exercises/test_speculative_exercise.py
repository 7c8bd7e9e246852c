"""CI for the speculative grader (minidist/grading/speculative.py): minidist's own answer gets full
marks, every broken version fails its task with a message, the untouched stub scores 0."""

from minidist.grading import grader_tests
from minidist.grading import speculative as G

test_reference_passes, test_broken_implementation_fails, test_grade_reports_the_stub_as_not_written = \
    grader_tests("speculative", G.CHECKS, G.reference, G.BROKEN)


def test_writing_into_the_callers_p_fails_naming_p():
    import types

    import pytest
    with pytest.raises(AssertionError, match=r"changed its input p: p\["):
        G.CHECKS["residual"](types.SimpleNamespace(residual=G._residual_in_place))
