"""CI for the kv_cache grader (minidist/grading/kv_cache.py): minidist's own answer gets full marks,
every broken version fails its task with a message, the untouched stub scores 0."""

from minidist.grading import grader_tests
from minidist.grading import kv_cache as G

test_reference_passes, test_broken_implementation_fails, test_grade_reports_the_stub_as_not_written = \
    grader_tests("kv_cache", G.CHECKS, G.reference, G.BROKEN)


def test_writing_into_the_callers_q_fails_naming_q():
    import types

    import pytest
    with pytest.raises(AssertionError, match=r"changed its input q: q\["):
        G.CHECKS["cached_attention_step"](types.SimpleNamespace(cached_attention_step=G._step_scales_q_in_place))
