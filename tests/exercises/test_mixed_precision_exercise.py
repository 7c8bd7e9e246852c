"""CI for the mixed_precision grader (minidist/grading/mixed_precision.py): minidist's own answer gets
full marks, every broken version fails its task with a message, the untouched stub scores 0."""

from minidist.grading import grader_tests
from minidist.grading import mixed_precision as G

test_reference_passes, test_broken_implementation_fails, test_grade_reports_the_stub_as_not_written = \
    grader_tests("mixed_precision", G.CHECKS, G.reference, G.BROKEN)


def test_writing_into_the_callers_state_fails_naming_state():
    import types

    import pytest
    with pytest.raises(AssertionError, match=r"changed its input state"):
        G.CHECKS["scaler_update"](types.SimpleNamespace(scaler_update=G._update_in_place))
