"""CI for the three_d grader (minidist/grading/three_d.py): minidist's own answer gets full marks,
every broken version fails its task with a message, the untouched stub scores 0."""

from minidist.grading import grader_tests
from minidist.grading import three_d as G

test_reference_passes, test_broken_implementation_fails, test_grade_reports_the_stub_as_not_written = \
    grader_tests("three_d", G.CHECKS, G.reference, G.BROKEN)
