"""Exercise 5b: design the ZB-H1 zero-bubble pipeline schedule as data, and its bubble.

1F1B's bubble is the time a stage waits for gradients to come back down the pipeline. Split every
backward in two -- B (``BackwardInput``: the gradient for the stage's input, which the previous
stage waits for) and W (``BackwardWeight``: the weight gradients, which nobody needs until the
optimizer step) -- send B's result on at once, put W off, and the put-off W's can fill the gaps where
the stage would have waited (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

A schedule is a list with one instruction list per stage, built from minidist's instruction
classes (imported below; see minidist/parallel/pipeline/instructions.py): ``Forward(mb)``,
``BackwardInput(mb)``, ``BackwardWeight(mb)``, ``SendAct(mb)`` / ``RecvAct(mb)`` (activations to
stage s+1 / from s-1), ``SendGrad(mb)`` / ``RecvGrad(mb)`` (gradients to s-1 / from s+1),
``SendRecv((op, op))`` (post both at once, done when both have matched) and ``OptimizerStep()``.
Sends and receives are BLOCKING: a send finishes only when its peer posts the matching receive.

Estimated time: 2 h (the order 1.5 h: draw it on squared paper first; the messages 20 min; bubble 10 min)
Grade it:  python -m minidist.grade zero_bubble
The grader runs your schedule through ``minidist.parallel.pipeline.simulate.simulate`` for p = 1..6
stages and m in {p, p + 1, 2p, 3p} microbatches and checks every constraint in ``zb_h1``'s spec.
Lesson: lessons/05-pipeline.md; the answer is in minidist/parallel/pipeline/zero_bubble.py, so try
before you look.
"""

from minidist.parallel.pipeline.schedule import (  # noqa: F401  (you will need them)
    BackwardInput,
    BackwardWeight,
    Forward,
    OptimizerStep,
    RecvAct,
    RecvGrad,
    SendAct,
    SendGrad,
    SendRecv,
)


def zb_h1(num_stages, num_microbatches):
    """ZB-H1: ``list`` of ``num_stages`` instruction lists. Raise ValueError unless
    num_stages >= 1 and num_microbatches >= num_stages.

    Design the order yourself; it must meet every one of these (stage s of p, m microbatches):

    * Work: every microbatch's F, B and W exactly once on every stage (no whole ``Backward``), and
      one ``OptimizerStep()`` at the end of every list.
    * Dependencies: F of microbatch i on stage s needs F of i on s-1; B of i on s needs B of i on s+1
      (on the last stage, its own F); W of i needs B of i on the same stage. Microbatches enter
      stage 0 in order 0, 1, ..., m-1.
    * Messages: a receive before the compute that needs it, a send after the compute that made it,
      and no deadlock when every send blocks until its receive is posted.
    * In flight: at most p - s microbatches between their F and their B on stage s (1F1B's limit:
      its peak activation memory, the paper's M_B).
    * Memory: at most p microbatches between their F and their W on any stage.
    * W order: each stage runs its W's in the order it ran their B's (the oldest put-off W first),
      so every weight gradient adds up its microbatches in 1F1B's order, bit for bit.
    * Speed: with F = B = W = 1 step and sends that complete in the background, the step ends by
      3m + p - 1 -- the floor: the last stage cannot start before step p - 1 and then has 3m steps of
      work. (1F1B takes 3(m + p - 1); a greedy "B, else F, else the oldest W" within these limits
      takes up to 2 steps more than the floor.)
    """
    raise NotImplementedError


def zb_h1_bubble(num_stages, num_microbatches):
    """The idle share of your ZB-H1 with F = B = W (each 1 step): a float in [0, 1). Count the
    idle steps of one stage in a makespan of 3m + p - 1 steps and compare with 1F1B's (p-1)/(m+p-1)."""
    raise NotImplementedError
