"""CI for the autograd grader (minidist/grading/autograd.py): minidist's own answer gets full marks, every
broken version in its BROKEN fails its task with a message, the untouched exercises/autograd.py scores 0."""

from minidist.grading import autograd as G
from minidist.grading import grader_tests

test_reference_passes, test_broken_implementation_fails, test_grade_reports_the_stub_as_not_written = \
    grader_tests("autograd", G.CHECKS, G.reference, G.BROKEN)


def test_writing_into_the_callers_x_fails_naming_x():
    import types

    import pytest
    with pytest.raises(AssertionError, match=r"changed its input x"):
        G.CHECKS["layer_norm_backward"](types.SimpleNamespace(layer_norm_backward=G._ln_centres_x_in_place))
