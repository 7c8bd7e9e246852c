"""The zero_bubble grader's checks each fail a broken version for ITS reason (a grader that passes a
broken version only because another check happens to fire would let the next student's variant of
that bug through): which check each broken order trips, by what it was made to break. One more broken
order here: stage 0 puts its W's off one microbatch longer than ZB-H1 -- it holds p + 1 microbatches
between Forward and BackwardWeight and only the memory check stands between it and full marks."""

import types

import pytest

from minidist.grading import zero_bubble as Z
from minidist.parallel.pipeline import schedule as S
from minidist.parallel.pipeline.placement import looped
from minidist.parallel.pipeline.zero_bubble import as_schedule, check_min

REASONS = {  # broken version -> the words of the check it breaks
    "_w_before_b": r"before what it depends on: .*BackwardWeight before the BackwardInput",
    "_forgets_last_w": r"runs BackwardWeight of mbs \[\], expected each of 0..0 once \(missing: \[0\]\)",
    "_sends_first": r"deadlocks with blocking sends",
    "_one_f_one_b_split_in_place": r"makespan 9 steps .* the floor 3m \+ p - 1 = 7",
    "_no_memory_cap": r"holds 2 microbatches between Forward and BackwardWeight at once; at most p = 1",
    "_whole_backward": r"runs Backward \(whole\) for mbs \[0\]",
    "_greedy_of_the_old_spec": r"makespan 11 steps .* the floor 3m \+ p - 1 = 10",
    "_newest_w_first": r"runs its W's for microbatches \[1, 0\], its B's for \[0, 1\]",
    "_one_more_in_flight": r"stage 1 holds 2 microbatches between Forward and BackwardInput at once; "
                           r"1F1B's limit there is p - s = 1",
    "_bubble_of_1f1b": r"zb_h1_bubble\(2, 2\) = 0.333",
    "_bubble_a_third_of_1f1b": r"zb_h1_bubble\(2, 2\) = 0.111",
}


@pytest.mark.parametrize("task, wrong", [(t, b) for t, bs in Z.BROKEN.items() for b in bs],
                         ids=lambda v: getattr(v, "__name__", v))
def test_each_broken_version_fails_for_its_own_reason(task, wrong):
    with pytest.raises(AssertionError, match=REASONS[wrong.__name__]):
        Z.CHECKS[task](types.SimpleNamespace(**{task: wrong}))


def _stage_0_one_w_later(p, m):
    """ZB-H1's order (p - s warm-up forwards; per microbatch j: B_j, W_{j-d}, the next F; the d W's
    left at the end) with d = s on stages 1.. but d = 1 on stage 0: by hand, at p = 1, m = 2 stage 0 runs
    F0 B0 F1 B1 W0 W1 and holds 2 = p + 1 between Forward and BackwardWeight."""
    check_min("zb_h1", p, m, p)
    order = []
    for s in range(p):
        d = 1 if s == 0 else s
        ops = [S.Forward(i) for i in range(p - s)]
        for j in range(m):
            ops += [S.BackwardInput(j)] + ([S.BackwardWeight(j - d)] if j >= d else [])
            ops += [S.Forward(p - s + j)] if p - s + j < m else []
        order.append(ops + [S.BackwardWeight(j) for j in range(max(0, m - d), m)])
    return as_schedule(order, looped(p))


def test_one_more_w_put_off_is_failed_by_the_memory_check_alone():
    letter = {S.Forward: "F", S.BackwardInput: "B", S.BackwardWeight: "W"}
    assert [letter[type(i)] + str(i.mb) for i in _stage_0_one_w_later(1, 2)[0] if isinstance(i, S.COMPUTE)] \
        == ["F0", "B0", "F1", "B1", "W0", "W1"]
    with pytest.raises(AssertionError, match=r"zb_h1\(1, 2\): stage 0 holds 2 microbatches between Forward "
                                             r"and BackwardWeight at once; at most p = 1"):
        Z.check_zb_h1(types.SimpleNamespace(zb_h1=_stage_0_one_w_later))
