"""CI for the offload grader (minidist/grading/offload.py): minidist's own answer gets full marks,
every broken version fails its task with a message, the untouched stub scores 0."""

from minidist.grading import grader_tests
from minidist.grading import offload as G

test_reference_passes, test_broken_implementation_fails, test_grade_reports_the_stub_as_not_written = \
    grader_tests("offload", G.CHECKS, G.reference, G.BROKEN)


def test_writing_into_the_callers_grads_fails_naming_grads():
    import types

    import pytest
    with pytest.raises(AssertionError, match=r"changed its input grads\[0\]"):
        G.CHECKS["offloaded_momentum_step"](types.SimpleNamespace(offloaded_momentum_step=G._step_momentum_in_grads))
