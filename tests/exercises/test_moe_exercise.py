"""CI for the grader minidist/grading/moe.py: minidist's own answer gets full marks, each
broken version in its BROKEN fails its task with a message, the untouched exercises/moe.py
scores 0 ("not written yet")."""

from minidist.grading import grader_tests
from minidist.grading import moe as G

test_reference_passes, test_broken_implementation_fails, test_grade_reports_the_stub_as_not_written = \
    grader_tests("moe", G.CHECKS, G.reference, G.BROKEN)


def test_writing_into_the_callers_probs_fails_naming_probs():
    import types

    import pytest
    with pytest.raises(AssertionError, match=r"changed its input probs: probs\["):
        G.CHECKS["top_k_route"](types.SimpleNamespace(top_k_route=G._route_masking_probs))
