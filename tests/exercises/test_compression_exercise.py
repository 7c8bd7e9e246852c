"""CI for the grader minidist/grading/compression.py: minidist's own answer gets full marks, each
broken version in its BROKEN fails its task with a message, the untouched exercises/compression.py
scores 0 ("not written yet")."""

from minidist.grading import compression as G
from minidist.grading import grader_tests

test_reference_passes, test_broken_implementation_fails, test_grade_reports_the_stub_as_not_written = \
    grader_tests("compression", G.CHECKS, G.reference, G.BROKEN)


def test_writing_into_the_callers_residual_fails_naming_residual():
    import types

    import pytest
    with pytest.raises(AssertionError, match=r"changed its input residual: residual\["):
        G.CHECKS["topk_with_error_feedback"](types.SimpleNamespace(topk_with_error_feedback=G._residual_accumulated_in_place))
