"""CI for the fp8 grader (minidist/grading/fp8.py): minidist's own answer gets full marks, every broken
version fails its task with a message, the untouched stub scores 0."""

from minidist.grading import fp8 as G
from minidist.grading import grader_tests

test_reference_passes, test_broken_implementation_fails, test_grade_reports_the_stub_as_not_written = \
    grader_tests("fp8", G.CHECKS, G.reference, G.BROKEN)


def test_writing_into_the_callers_x_fails_naming_x():
    import types

    import pytest
    with pytest.raises(AssertionError, match=r"changed its input x: x\["):
        G.CHECKS["block_quantize"](types.SimpleNamespace(block_quantize=G._abs_in_place))
