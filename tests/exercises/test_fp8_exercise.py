"""CI for the fp8 grader (minidist/grading/fp8.py): minidist's own answer gets full marks, every broken
version fails its task with a message, the untouched stub scores 0."""

from minidist.grading import fp8 as G
from minidist.grading import grader_tests

test_reference_passes, test_broken_implementation_fails, test_grade_reports_the_stub_as_not_written = \
    grader_tests("fp8", G.CHECKS, G.reference, G.BROKEN)
