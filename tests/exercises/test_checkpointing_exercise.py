"""CI for the checkpointing grader (minidist/grading/checkpointing.py): minidist's own answer gets
full marks, every broken version fails its task with a message, the untouched stub scores 0."""

from minidist.grading import checkpointing as G
from minidist.grading import grader_tests

test_reference_passes, test_broken_implementation_fails, test_grade_reports_the_stub_as_not_written = \
    grader_tests("checkpointing", G.CHECKS, G.reference, G.BROKEN)
