"""CI for the grader minidist/grading/collective_matmul.py: minidist's own answer gets full marks, each
broken version in its BROKEN fails its task with a message, the untouched exercises/collective_matmul.py
scores 0 ("not written yet")."""

import pytest

from minidist.grading import collective_matmul as G
from minidist.grading import grader_tests

test_reference_passes, test_broken_implementation_fails, test_grade_reports_the_stub_as_not_written = \
    grader_tests("collective_matmul", G.CHECKS, G.reference, G.BROKEN)


def test_writing_into_the_callers_x_fails_naming_x():
    import types

    import pytest
    with pytest.raises(AssertionError, match=r"changed its input x: x\["):
        G.CHECKS["all_gather_matmul"](types.SimpleNamespace(all_gather_matmul=G._recv_into_x))


def test_a_blocking_ring_fails_naming_the_deadlock():
    """send-then-receive round a ring: on MPI with large chunks every rank waits in its send; the
    grader runs on rendezvous sends, so it fails at once and names the cycle (issue 41)."""
    import types

    import pytest
    with pytest.raises(AssertionError, match=r"deadlock: rank \d waits in send to rank \d"):
        G.CHECKS["all_gather_matmul"](types.SimpleNamespace(all_gather_matmul=G._blocking_ring))


@pytest.mark.parametrize("task, broken", [("all_gather_matmul", G._wait_then_multiply),
                                          ("matmul_reduce_scatter", G._sendrecv_sum)])
def test_finishing_each_hop_before_its_multiply_fails_by_the_order_of_events(task, broken):
    """Right numbers, right bytes, but every hop waited for before the multiply beside it: the event
    log (not a stopwatch) shows nothing was hidden (issue 41)."""
    import types
    with pytest.raises(AssertionError, match=r"finished before any multiply started beside it"):
        G.CHECKS[task](types.SimpleNamespace(**{task: broken}))
