"""CI for the grader minidist/grading/collective_matmul.py: minidist's own answer gets full marks, each
broken version in its BROKEN fails its task with a message, the untouched exercises/collective_matmul.py
scores 0 ("not written yet")."""

from minidist.grading import collective_matmul as G
from minidist.grading import grader_tests

test_reference_passes, test_broken_implementation_fails, test_grade_reports_the_stub_as_not_written = \
    grader_tests("collective_matmul", G.CHECKS, G.reference, G.BROKEN)


def test_writing_into_the_callers_x_fails_naming_x():
    import types

    import pytest
    with pytest.raises(AssertionError, match=r"changed its input x: x\["):
        G.CHECKS["all_gather_matmul"](types.SimpleNamespace(all_gather_matmul=G._recv_into_x))
