"""CI for the zero_bubble grader (minidist/grading/zero_bubble.py): minidist's ZB-H1 gets full marks, every
broken version in its BROKEN fails its task with a message, the untouched exercises/zero_bubble.py scores
0, and a schedule written from the exercise's spec alone passes."""

from minidist.grading import grader_tests
from minidist.grading import zero_bubble as G

test_reference_passes, test_broken_implementation_fails, test_grade_reports_the_stub_as_not_written = \
    grader_tests("zero_bubble", G.CHECKS, G.reference, G.BROKEN)


def _zb_h1_from_the_spec(p, m):
    """A design worked out from exercises/zero_bubble.py's constraints alone, without minidist's code:
    stage s fills its in-flight limit p - s with forwards, then cycles B, W, F keeping s W's in reserve
    for the cool-down (where it would wait for gradients), then spends the reserve. Messages as
    Megatron-LM posts them: each send together with the next receive. It must pass."""
    from collections import deque

    from minidist.parallel.pipeline import schedule as S

    if p < 1 or m < p:
        raise ValueError("needs num_stages >= 1 and num_microbatches >= num_stages")
    sched = []
    for s in range(p):
        todo_f, todo_b, reserve, ops = deque(range(m)), deque(range(m)), deque(), []
        while len(ops) < p - s:
            ops.append(S.Forward(todo_f.popleft()))
        while todo_b:
            reserve.append(todo_b.popleft())
            ops.append(S.BackwardInput(reserve[-1]))
            if len(reserve) > s:
                ops.append(S.BackwardWeight(reserve.popleft()))
            if todo_f:
                ops.append(S.Forward(todo_f.popleft()))
        ops += [S.BackwardWeight(mb) for mb in reserve]

        def recv(op, s=s):
            if isinstance(op, S.Forward) and s > 0:
                return S.RecvAct(op.mb)
            return S.RecvGrad(op.mb) if isinstance(op, S.BackwardInput) and s < p - 1 else None

        def send(op, s=s):
            if isinstance(op, S.Forward) and s < p - 1:
                return S.SendAct(op.mb)
            return S.SendGrad(op.mb) if isinstance(op, S.BackwardInput) and s > 0 else None
        out = [x for x in [recv(ops[0])] if x]
        for k, op in enumerate(ops):
            both = [x for x in (send(op), recv(ops[k + 1]) if k + 1 < len(ops) else None) if x]
            out += [op] + ([S.SendRecv(tuple(both))] if len(both) == 2 else both)
        sched.append(out + [S.OptimizerStep()])
    return sched


def test_a_schedule_written_from_the_spec_alone_passes():
    import types

    G.check_zb_h1(types.SimpleNamespace(zb_h1=_zb_h1_from_the_spec))


def test_each_new_broken_version_fails_with_its_own_message():
    """The W order the spec forbids (newest put-off W first) is named as such; the old spec's greedy
    (B, else F, else the oldest W), one or two steps above the floor, is failed on its makespan."""
    import types

    import pytest

    w_order = (r"zb_h1\(2, 2\): stage 1 runs its W's for microbatches \[1, 0\], its B's for \[0, 1\]; "
               r"the spec's W order")
    with pytest.raises(AssertionError, match=w_order):
        G.check_zb_h1(types.SimpleNamespace(zb_h1=G._newest_w_first))
    floor = r"zb_h1\(2, 3\): makespan 11 steps .* the floor 3m \+ p - 1 = 10"
    with pytest.raises(AssertionError, match=floor):
        G.check_zb_h1(types.SimpleNamespace(zb_h1=G._greedy_of_the_old_spec))
    in_flight = r"zb_h1\(2, 2\): stage 1 holds 2 microbatches between Forward and BackwardInput .* p - s = 1"
    with pytest.raises(AssertionError, match=in_flight):
        G.check_zb_h1(types.SimpleNamespace(zb_h1=G._one_more_in_flight))
