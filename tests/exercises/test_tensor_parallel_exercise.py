"""CI for the tensor_parallel grader (minidist/grading/tensor_parallel.py): minidist's own answer gets
full marks, every broken version fails its task with a message, the untouched stub scores 0, and
ranks that hang fail the task in seconds."""

import types

import pytest

from minidist.grading import grader_tests
from minidist.grading import tensor_parallel as G

test_reference_passes, test_broken_implementation_fails, test_grade_reports_the_stub_as_not_written = \
    grader_tests("tensor_parallel", G.CHECKS, G.reference, G.BROKEN)


@pytest.mark.parametrize("task", list(G.HANGS))
def test_ranks_that_hang_fail_in_seconds(task, monkeypatch):
    monkeypatch.setattr(G, "WAIT_S", 1)
    with pytest.raises(AssertionError, match="hung"):
        G.CHECKS[task](types.SimpleNamespace(**{task: G.HANGS[task]}))


def test_writing_into_the_callers_logits_shard_fails_naming_logits_shard():
    import types

    import pytest
    with pytest.raises(AssertionError, match=r"changed its input logits_shard"):
        G.CHECKS["vocab_parallel_cross_entropy"](types.SimpleNamespace(vocab_parallel_cross_entropy=G._ce_shifts_logits_in_place))
