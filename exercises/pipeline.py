"""Exercise 5: write the 1F1B pipeline schedule as data, and its bubble.

A schedule is a list with one instruction list per stage: ``schedule[s]`` is what stage s runs, in
order. Build it from minidist's instruction classes (imported below): ``Forward(mb)``,
``Backward(mb)``, ``SendAct(mb)`` / ``RecvAct(mb)`` (activations go to stage s+1 / come from s-1),
``SendGrad(mb)`` / ``RecvGrad(mb)`` (gradients go to s-1 / come from s+1) and ``OptimizerStep()``.
Sends and receives are BLOCKING: a send finishes only when its peer posts the matching receive.
Stage 0 never receives activations and the last stage never receives gradients.

Estimated time: 1 h (1F1B 50 min, bubble 10 min)
Grade it:  python -m minidist.grade pipeline
The grader runs your schedule through ``minidist.parallel.pipeline.simulate.simulate`` for p = 1..6 stages
and m = 1..10 microbatches: no deadlock, every microbatch forward then backward exactly once on every
stage, at most min(m, p - s) activations held on stage s, the same makespan as minidist's 1F1B.
Lesson: lessons/05-pipeline.md; the answer is in minidist/parallel/pipeline/schedule.py, so try
before you look.
"""

from minidist.parallel.pipeline.schedule import (  # noqa: F401  (you will need them)
    Backward,
    Forward,
    OptimizerStep,
    RecvAct,
    RecvGrad,
    SendAct,
    SendGrad,
)


def one_f_one_b(num_stages, num_microbatches):
    """The 1F1B (PipeDream-Flush) schedule: ``list`` of ``num_stages`` instruction lists.

    Stage s (of p) first runs ``min(p - 1 - s, m)`` warm-up forwards (each: RecvAct unless s == 0,
    Forward, SendAct unless s is last), then alternates one forward and one backward until the m
    forwards are done, then runs the remaining backwards (RecvGrad unless last, Backward, SendGrad
    unless s == 0), and ends with one ``OptimizerStep()``. Microbatches go in order 0..m-1 both ways.

    Deadlock: in the steady state stage s does ``SendAct(i); RecvGrad(j)`` towards stage s+1, so
    stage s+1 must post the mirror order: after a backward, receive the next forward's input
    (``RecvAct``) *before* sending the gradient back (``SendGrad``).
    Raise ValueError if num_stages < 1 or num_microbatches < 1.
    """
    raise NotImplementedError


def bubble_fraction(num_stages, num_microbatches):
    """The idle share of p stages x the makespan for GPipe and 1F1B (forward and backward count as
    busy, communication is free): a float in [0, 1). Derive it from a timeline of p = 4, m = 8."""
    raise NotImplementedError
