"""CI for the grader minidist/grading/load_balancing.py: minidist's own answer gets full marks, each
broken version in its BROKEN fails its task with a message, the untouched exercises/load_balancing.py
scores 0 ("not written yet")."""

from minidist.grading import grader_tests
from minidist.grading import load_balancing as G

test_reference_passes, test_broken_implementation_fails, test_grade_reports_the_stub_as_not_written = \
    grader_tests("load_balancing", G.CHECKS, G.reference, G.BROKEN)


def test_writing_into_the_callers_costs_fails_naming_costs():
    import types

    import pytest
    with pytest.raises(AssertionError, match=r"changed its input costs"):
        G.CHECKS["min_max_partition"](types.SimpleNamespace(min_max_partition=G._prefix_sums_in_place))
