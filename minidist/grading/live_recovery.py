"""Grader for exercises/live_recovery.py: the quorum-averaged gradient, the donor, the healer's step.

``quorum_average`` runs on thread ranks (``run_guarded``: a rank left waiting fails in seconds) with
1-4 participants and 0-2 healers, random sizes and values, and must equal the serial left-to-right sum
divided by n bit for bit on every rank -- healers too. ``donor_of`` is asked about random quorums.
``heal_step`` drives a toy replica (parameters, Adam-like moment, a data position, an RNG) against a
survivor that took the same step: equal at the end, or the order was wrong. In CI these run against
minidist's own code (``reference``: must pass) and the broken versions in ``BROKEN`` (must fail).
"""

import types

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from minidist.comm import ring_all_reduce, two_shot_all_reduce
from minidist.grading import assert_close, no_hang, run_guarded, untouched
from minidist.parallel.data.live.quorum_ddp import StaticView, quorum_average

GRADE = settings(max_examples=15, deadline=None, derandomize=True, database=None, report_multiple_bugs=False)
POINTS = {"quorum_average": 2, "donor_of": 1, "heal_step": 1}


def check_quorum_average(impl):
    fn = untouched(impl.quorum_average, ["view", "x"])

    @GRADE
    @given(n=st.integers(1, 4), healers=st.integers(0, 2), size=st.integers(1, 40), seed=st.integers(0, 999))
    def prop(n, healers, size, seed):
        xs = [np.random.default_rng([seed, r]).standard_normal(size) * 10.0 ** (r - 2) for r in range(n)]
        want = xs[0].copy()
        for x in xs[1:]:
            want = want + x
        want = want / n

        def body(comm):
            part = comm.split(0 if comm.rank < n else None, comm.rank)
            x = xs[comm.rank] if comm.rank < n else np.full(size, np.nan)
            return fn(StaticView(part, comm, n), x)
        for r, got in enumerate(run_guarded(body, n + healers)):
            role = "participant" if r < n else "healer"
            assert_close(got, want, f"rank {r} ({role}) of {n} participants + {healers} healers, size {size}")
    no_hang(prop)


def _quorum(rng, groups, k):
    table = {g: [int(m) for m in rng.permutation(100)[:k] + 100 * g] for g in range(groups)}
    healers = [g for g in range(groups) if rng.random() < 0.4]
    part = [g for g in range(groups) if g not in healers] or [healers.pop()]
    healing = {h: int(rng.choice(part)) for h in healers}
    return {"participants": part, "healing": healing, "table": table}


def check_donor_of(impl):
    @GRADE
    @given(groups=st.integers(2, 5), k=st.integers(1, 4), seed=st.integers(0, 999))
    def prop(groups, k, seed):
        q = _quorum(np.random.default_rng(seed), groups, k)
        for g in range(groups):
            for pos in range(k):
                want = q["table"][q["healing"][g]][pos] if g in q["healing"] else None
                got = impl.donor_of(q, g, pos)
                who = "nobody (it takes part)" if want is None else f"member {want}"
                assert got == want, f"quorum {q}: group {g}, position {pos} heals from {who}, got {got!r}"
    prop()


class _Replica:
    """A toy replica: parameters, a moment, a data position, an RNG -- what a heal moves."""

    def __init__(self, seed):
        rng = np.random.default_rng(seed)
        self.p, self.m = rng.standard_normal(6), np.zeros(6)
        self.position, self.rng = int(rng.integers(100)), np.random.default_rng(seed + 1)

    def state(self):
        return self.p.copy(), self.m.copy(), self.position, self.rng.bit_generator.state

    def load(self, state):
        self.p, self.m, self.position = state[0].copy(), state[1].copy(), state[2]
        self.rng.bit_generator.state = state[3]

    def begin_step(self):
        self.position += 4
        return self.rng.integers(1 << 30)

    def optimizer_step(self, g):
        self.m = 0.9 * self.m + 0.1 * g
        self.p = self.p - 0.01 * self.m


def check_heal_step(impl):
    @GRADE
    @given(seed=st.integers(0, 999), steps=st.integers(1, 3))
    def prop(seed, steps):
        donor, healer = _Replica(seed), _Replica(seed + 1000)
        for _ in range(steps):  # the donor trains a while before the failure
            donor.begin_step()
            donor.optimizer_step(donor.rng.standard_normal(6))
        start = donor.state()   # the donor's state at the start of the heal step
        donor.begin_step()
        avg = np.random.default_rng(seed + 7).standard_normal(6)
        donor.optimizer_step(avg)
        calls = []

        def rec(name, f):
            def g(*a):
                calls.append(name)
                return f(*a)
            return g
        impl.heal_step(rec("take_state", lambda: healer.load(start)), rec("begin_step", healer.begin_step),
                       rec("receive_average", lambda: avg.copy()),
                       rec("optimizer_step", healer.optimizer_step))
        where = f"after {steps} steps, calls {calls}"
        assert_close(healer.p, donor.p, f"parameters ({where})")
        assert_close(healer.m, donor.m, f"the optimizer's moment ({where})")
        assert healer.position == donor.position, (f"data position {healer.position}, the survivor's is "
                                                   f"{donor.position} ({where}): the step's bookkeeping")
        assert healer.rng.bit_generator.state == donor.rng.bit_generator.state, f"the RNG differs ({where})"
    prop()


CHECKS = {"quorum_average": check_quorum_average, "donor_of": check_donor_of, "heal_step": check_heal_step}


# -- minidist's own implementation (must pass) -------------------------------------------------------

def reference():
    def donor_of(quorum, group, pos):
        donor = quorum["healing"].get(group)
        return None if donor is None else quorum["table"][donor][pos]

    def heal_step(take_state, begin_step, receive_average, optimizer_step):
        take_state()          # the donor's start-of-step state first: what follows moves it on
        begin_step()          # then this step's bookkeeping, as every replica does it
        optimizer_step(receive_average())
    return types.SimpleNamespace(quorum_average=quorum_average, donor_of=donor_of, heal_step=heal_step)


# -- realistic mistakes (must fail) ------------------------------------------------------------------

def _counts_healers(view, x):  # divides by everyone, healers included
    avg = None
    if view.participants is not None:
        avg = two_shot_all_reduce(view.participants, x, "sum") / view.everyone.size
    if view.everyone.rank == 0:
        for r in range(view.n, view.everyone.size):
            view.everyone.send(avg, r)
    elif view.everyone.rank >= view.n:
        avg = view.everyone.recv(0)
    return avg


def _ring_order(view, x):  # a ring all-reduce adds each chunk up in another order: not the twin's bits
    avg = ring_all_reduce(view.participants, x) / view.n if view.participants is not None else None
    if view.everyone.rank == 0:
        for r in range(view.n, view.everyone.size):
            view.everyone.send(avg, r)
    elif view.everyone.rank >= view.n:
        avg = view.everyone.recv(0)
    return avg


def _healers_forgotten(view, x):
    if view.participants is None:
        return None
    return two_shot_all_reduce(view.participants, x, "sum") / view.n


def _first_position(quorum, group, pos):  # always the donor's first member
    donor = quorum["healing"].get(group)
    return None if donor is None else quorum["table"][donor][0]


def _own_group(quorum, group, pos):  # heals from its own group's table (that is itself)
    return quorum["table"][group][pos] if group in quorum["healing"] else None


def _bookkeeping_first(take_state, begin_step, receive_average, optimizer_step):
    begin_step()
    take_state()          # overwrites the step's bookkeeping with the start-of-step state
    optimizer_step(receive_average())


def _no_bookkeeping(take_state, begin_step, receive_average, optimizer_step):
    take_state()
    optimizer_step(receive_average())


def _heal_last(take_state, begin_step, receive_average, optimizer_step):
    begin_step()
    optimizer_step(receive_average())
    take_state()          # the donor's start-of-step state: this step is undone


BROKEN = {"quorum_average": [_counts_healers, _ring_order, _healers_forgotten],
          "donor_of": [_first_position, _own_group],
          "heal_step": [_bookkeeping_first, _no_bookkeeping, _heal_last]}
