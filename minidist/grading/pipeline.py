"""Grader for exercises/pipeline.py: the student's 1F1B schedule, run by minidist's simulator.

``CHECKS[task](impl)`` raises AssertionError when ``impl.<task>`` is wrong. They run here against
minidist's own schedule (must pass) and deliberately broken ones (must fail): GPipe's order (right
answer, m activations held), the gradient sent before the next input is received (deadlock), a
microbatch left out. ``python -m minidist.grade pipeline`` runs them on a student's file.
"""

import types

from hypothesis import example, given, settings
from hypothesis import strategies as st

from minidist.parallel.pipeline import schedule as S
from minidist.parallel.pipeline.simulate import DeadlockError, bubble_formula, simulate

GRADE = settings(max_examples=25, deadline=None, derandomize=True, database=None, report_multiple_bugs=False)
SIZES = dict(p=st.integers(1, 6), m=st.integers(1, 10))


def _simulated(sched, p, m):
    """simulate(sched), with a structural error or a deadlock turned into a failed check."""
    what = f"one_f_one_b({p}, {m})"
    assert isinstance(sched, list) and len(sched) == p, f"{what} must return a list of {p} stage lists"
    try:
        return simulate(sched)
    except DeadlockError as e:
        raise AssertionError(f"{what} deadlocks: {e}") from None
    except S.ScheduleError as e:
        raise AssertionError(f"{what} is not a valid schedule: {e}") from None


def check_one_f_one_b(impl):
    @GRADE
    @given(**SIZES)
    @example(p=1, m=1)  # tried first: a stub fails fast, unshrunk
    def prop(p, m):
        what = f"one_f_one_b({p}, {m})"
        sched = impl.one_f_one_b(p, m)
        result = _simulated(sched, p, m)
        for s, ops in enumerate(sched):
            for kind in (S.Forward, S.Backward):
                mbs = sorted(i.mb for i in ops if isinstance(i, kind))
                assert mbs == list(range(m)), f"{what}: stage {s} runs {kind.__name__} of mbs {mbs}, " \
                                              f"expected each of 0..{m - 1} once"
            steps = [k for k, i in enumerate(ops) if isinstance(i, S.OptimizerStep)]
            assert steps == [len(ops) - 1], f"{what}: stage {s} must end with exactly one OptimizerStep()"
            assert result.peak_activations[s] == min(m, p - s), (
                f"{what}: stage {s} holds {result.peak_activations[s]} microbatches' activations at once; "
                f"1F1B holds min(m, p - s) = {min(m, p - s)}")
        want = (m + p - 1) * (1.0 + 2.0)  # (m + p - 1) slots of forward (1) + backward (2): no extra bubble
        assert result.makespan == want, f"{what}: makespan {result.makespan}, 1F1B takes {want}"
    prop()
    for bad in [(0, 4), (3, 0)]:
        try:
            impl.one_f_one_b(*bad)
        except ValueError:
            continue
        raise AssertionError(f"one_f_one_b{bad} must raise ValueError (needs >= 1 stage and microbatch)")


def check_bubble_fraction(impl):
    @GRADE
    @given(**SIZES)
    @example(p=1, m=1)  # tried first: a stub fails fast, unshrunk
    def prop(p, m):
        got = impl.bubble_fraction(p, m)
        want = (p - 1) / (m + p - 1)  # the textbook formula, written out
        assert abs(got - want) < 1e-12, f"bubble_fraction({p}, {m}) = {got}; expected (p-1)/(m+p-1) = {want}"
    prop()


CHECKS = {"one_f_one_b": check_one_f_one_b, "bubble_fraction": check_bubble_fraction}


def reference():
    return types.SimpleNamespace(one_f_one_b=S.one_f_one_b, bubble_fraction=bubble_formula)


# -- deliberately broken implementations (must fail) ---------------------------------------------

def _gpipe_order(p, m):  # right results, but all forwards first: stage s holds m activations
    return S.gpipe(p, m)


def _send_grad_first(p, m):  # after a backward, SendGrad before RecvAct: neighbours both send
    sched = S.one_f_one_b(p, m)
    for ops in sched:
        for k in range(len(ops) - 1):
            if isinstance(ops[k], S.RecvAct) and isinstance(ops[k + 1], S.SendGrad):
                ops[k], ops[k + 1] = ops[k + 1], ops[k]
    return sched


def _drops_last_microbatch(p, m):  # forgets microbatch m - 1 (every stage agrees, so it runs)
    keep = [[i for i in ops if getattr(i, "mb", None) != m - 1] for ops in S.one_f_one_b(p, m)]
    return keep if m > 1 else S.one_f_one_b(p, m)


def _bubble_over_m(p, m):  # the bubble relative to the ideal time, not a share of the whole
    return (p - 1) / m


BROKEN = {"one_f_one_b": [_gpipe_order, _send_grad_first, _drops_last_microbatch],
          "bubble_fraction": [_bubble_over_m]}
