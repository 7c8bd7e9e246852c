"""CI for the grader minidist/grading/live_recovery.py: minidist's own answer gets full marks, each broken
version in its BROKEN fails its task with a message, the untouched exercises/live_recovery.py scores 0."""

from minidist.grading import grader_tests
from minidist.grading import live_recovery as G

test_reference_passes, test_broken_implementation_fails, test_grade_reports_the_stub_as_not_written = \
    grader_tests("live_recovery", G.CHECKS, G.reference, G.BROKEN)
