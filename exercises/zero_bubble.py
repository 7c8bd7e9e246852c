"""Exercise 5b: write the ZB-H1 zero-bubble pipeline schedule as data, and its bubble.

1F1B's bubble is the time a stage waits for gradients to come back down the pipeline. Split every
backward in two -- B (``BackwardInput``: the gradient for the stage's input, which the previous
stage waits for) and W (``BackwardWeight``: the weight gradients, which nobody needs until the
optimizer step) -- send B's result on at once, put W off, and the put-off W's fill the gaps where
the stage would have waited (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

A schedule is a list with one instruction list per stage, built from minidist's instruction
classes (imported below; see minidist/parallel/pipeline/instructions.py): ``Forward(mb)``,
``BackwardInput(mb)``, ``BackwardWeight(mb)``, ``SendAct(mb)`` / ``RecvAct(mb)`` (activations to
stage s+1 / from s-1), ``SendGrad(mb)`` / ``RecvGrad(mb)`` (gradients to s-1 / from s+1),
``SendRecv((op, op))`` (post both at once, done when both have matched) and ``OptimizerStep()``.
Sends and receives are BLOCKING: a send finishes only when its peer posts the matching receive.

Estimated time: 1.5 h (the greedy order 1 h, the messages 20 min, bubble 10 min)
Grade it:  python -m minidist.grade zero_bubble
The grader runs your schedule through ``minidist.parallel.pipeline.simulate.simulate`` for p = 1..6
stages and m in {p, 2p, 3p} microbatches: every microbatch's F, B and W exactly once on every stage
in an order the dependencies allow, no deadlock with blocking sends, at most p microbatches between
F and W on any stage (1F1B's peak memory), and with F = B = W = 1 and background sends a makespan
within 2 steps of the ideal 3m + p - 1 (1F1B takes 3(m + p - 1)).
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
    num_stages >= 1 and num_microbatches >= num_stages (fewer cannot fill the cool-down).

    1. The compute order. Simulate unit time steps t = 0, 1, 2, ... (F = B = W = 1; a message sent
       in step t arrives for step t + 1). Stage 0 has every microbatch's input at t = 0. In each
       step, every stage s (in the order 0..p-1) takes the first of:
       * B of its oldest microbatch without one, if that microbatch's gradient is here (the last
         stage: its own F finished, i.e. one step after its F); it then sends the gradient on to
         s-1 and puts that microbatch's W off;
       * F of its next microbatch, if its input is here and fewer than p - s microbatches are
         between F and B on this stage (1F1B's warm-up limit) and fewer than p between F and W
         (1F1B's peak memory);
       * W of its oldest put-off microbatch;
       * nothing (a bubble).
       Stop when every stage has run all m B's and W's.
    2. The messages, around that order on stage s: before the first compute op, its receive
       (``RecvAct(mb)`` for an F unless s == 0, ``RecvGrad(mb)`` for a B unless s is the last stage;
       W needs none). After each compute op, one ``SendRecv`` holding the send of the op just done
       (``SendAct`` after an F unless s is last, ``SendGrad`` after a B unless s == 0) and the
       receive of the next op -- or just the one of them that exists, or nothing. Posting both at
       once is what keeps neighbours from both waiting in a send.
    3. End every stage with one ``OptimizerStep()``.
    """
    raise NotImplementedError


def zb_h1_bubble(num_stages, num_microbatches):
    """The ideal idle share of ZB-H1 with F = B = W (each 1 step): a float in [0, 1). Count the
    idle steps of one stage in a makespan of 3m + p - 1 steps (only the B chain waits) and compare
    with 1F1B's (p-1)/(m+p-1)."""
    raise NotImplementedError
