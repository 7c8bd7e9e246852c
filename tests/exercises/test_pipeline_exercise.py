"""CI for the pipeline grader (minidist/grading/pipeline.py): minidist's own answer gets full marks, every
broken version in its BROKEN fails its task with a message, the untouched exercises/pipeline.py scores 0."""

from minidist.grading import grader_tests
from minidist.grading import pipeline as G

test_reference_passes, test_broken_implementation_fails, test_grade_reports_the_stub_as_not_written = \
    grader_tests("pipeline", G.CHECKS, G.reference, G.BROKEN)
