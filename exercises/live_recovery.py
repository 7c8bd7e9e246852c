"""Exercise 10b: live recovery -- the average over a step's quorum, and a replacement's heal.

Replica groups train with a quorum per step: the groups that take part (the participants) average
their gradients; a replacement group heals during a step from a live peer and then steps like
everyone. Three small pieces of minidist.resilience.live and minidist.parallel.data.live:

Estimated time: 45 min (the average 25 min, the donor 5 min, the healer's step 15 min)
Grade it:  python -m minidist.grade live_recovery
The grader runs your average on thread ranks with random numbers of participants and healers and
compares it with the serial sum bit for bit; it asks your donor for random quorums; and it runs your
healer's step against a survivor's, on a toy replica with a data position and an RNG.
Lesson: lessons/10-fault-tolerance.md (section 6); minidist's answer is
minidist/parallel/data/live/quorum_ddp.py (quorum_average) and minidist/resilience/live/member.py
(LiveMember.view, LiveMember._heal), so try before you look.
"""

import numpy as np  # noqa: F401

from minidist.comm import two_shot_all_reduce  # noqa: F401  (it adds up in rank order)


def quorum_average(view, x):
    """The mean of ``x`` over the groups taking part in this step, on every rank of ``view.everyone``.

    ``view.participants``: a communicator over this position's ranks of the participating groups, in
    group order (None on a healer); ``view.everyone``: the participants (ranks 0..n-1), then the healers
    (ranks n..); ``view.n``: the number of participants. Return sum(x of the participants) / n, summed
    in rank order -- ((x0 + x1) + x2) + ... -- so the result is the serial twin's bit for bit, whichever
    groups took part (``two_shot_all_reduce(comm, x, "sum")`` adds up in rank order). A healer's ``x``
    is meaningless (it computed nothing): it receives the average from rank 0 of ``view.everyone``
    (``send``/``recv``). Every rank returns the same array. Does not modify ``x``.
    """
    raise NotImplementedError


def donor_of(quorum, group, pos):
    """The member a replacement at position ``pos`` of ``group`` heals from, or None if it does not heal.

    ``quorum``: {"participants": [group, ...], "healing": {healer group: donor group},
    "table": {group: [member id at position 0, 1, ...]}}. A healer takes the state of the member at
    the same position (the same tensor/pipeline shard: the same layout) in its donor group.
    """
    raise NotImplementedError


def heal_step(take_state, begin_step, receive_average, optimizer_step):
    """A replacement's first step, the one it heals in: call the four in an order that leaves it equal
    to a survivor at the end of the step.

    ``take_state()``: load the donor's state -- parameters, optimizer state, RNG, data position -- as it
    was at the START of this step. ``begin_step()``: the step's bookkeeping every replica does (take
    the step's batch: the data position moves; draw the step's seed: the RNG moves). ``receive_average()``
    -> the step's averaged gradient (the participants computed it). ``optimizer_step(avg)``: apply it.
    Returns nothing.
    """
    raise NotImplementedError
