"""CI for the grader minidist/grading/long_context.py: minidist's own answer gets full marks, each
broken version in its BROKEN fails its task with a message, the untouched exercises/long_context.py
scores 0 ("not written yet")."""

from minidist.grading import grader_tests
from minidist.grading import long_context as G

test_reference_passes, test_broken_implementation_fails, test_grade_reports_the_stub_as_not_written = \
    grader_tests("long_context", G.CHECKS, G.reference, G.BROKEN)


def test_writing_into_the_callers_out_a_fails_naming_out_a():
    import types

    import pytest
    with pytest.raises(AssertionError, match=r"changed its input out_a: out_a\["):
        G.CHECKS["merge_attention"](types.SimpleNamespace(merge_attention=G._merged_into_a))
