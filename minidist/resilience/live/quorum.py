"""The coordinator: which replica groups take part in each step, and what happens when one fails.

A state machine, fed events (a member registered, is ready, reported, beat, was lost) and answering
with messages to members through ``send(member, message)``; the links (links.py) and the launchers
(launch.py) feed it. Per step ``s``:

1. **Quorum.** Once every member of every active group is ready for ``s``, the participants ``P`` are
   the active groups; a complete replacement group joins as a *healer* with a donor (the lowest
   participant). Message ``("quorum", s, attempt, P, {healer: donor}, table, saver)``.
2. **Reports.** Each member reports its reduction (ok or not). All ok: ``("commit", s, attempt)``,
   the healers become participants, and the step is recorded (``history``).
3. **A failure** (a link closed, a launcher's notice, a heartbeat silent for ``hang_timeout``): the
   whole group leaves. If it was in this step, the step's communicators are revoked and the step is
   tried again (``attempt + 1``) by the groups left: they keep their gradients and redo only the
   reduction. No group left: ``LastGroupLost`` naming the step and the checkpoint to restart from.

Every change of the set is said in one line (``say``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from minidist.resilience.live.errors import LastGroupLost, LiveError

PHASES = ("ready", "heal", "compute", "reduce", "done")  # how far a member got in a step


@dataclass
class Incarnation:
    """One life of a replica group: its members by position (None: not registered yet)."""
    group: int
    number: int
    members: list
    state: str = "joining"   # joining -> (ready to heal) -> healing -> active -> lost


@dataclass
class StepRecord:
    """A committed step: who contributed, who healed (healer -> donor group), how many attempts."""
    step: int
    participants: tuple
    healing: dict = field(default_factory=dict)
    attempts: int = 1
    lost: list = field(default_factory=list)   # (group, why) lost during this step
    t0: float = 0.0                            # when its quorum was sent, and when it committed
    t1: float = 0.0


class Coordinator:
    """Decides each step's quorum (see the module docstring). ``rows``: rows of the batch per group
    (the effective batch is ``rows x |P|``); ``checkpoint()``: the newest checkpoint step, or None;
    ``replace(group)``: asks a launcher for a replacement group; ``heal_when(step)``: may a replacement
    heal during ``step`` (default: any step)."""

    def __init__(self, groups: int, group_size: int, steps: int, send, *, start_step: int = 0,
                 hang_timeout: float = 10.0, rows: int = 1, say=print, now=time.monotonic, replace=None,
                 checkpoint=None, max_retries: int = 3, heal_when=None):
        self.G, self.k, self.steps, self.send = groups, group_size, steps, send
        self.hang_timeout, self.rows, self.say, self.now = hang_timeout, rows, say, now
        self.replace, self.checkpoint, self.max_retries = replace, checkpoint, max_retries
        self.heal_when = heal_when  # step -> may a replacement heal in it (LocalSGD: a sync step only)
        self.groups = {g: Incarnation(g, 0, [None] * group_size) for g in range(groups)}
        self.where: dict = {}       # member -> (incarnation, position)
        self.step, self.attempt, self.retries = start_step, 0, 0
        self.pending = None         # (P, H) of the step being tried, or None at a step boundary
        self.reports: dict = {}     # member -> ok, for (step, attempt)
        self.ready: set = set()     # members ready for self.step
        self.beats: dict = {}       # member -> (time, phase, step)
        self.owed: dict = {}        # member -> time the coordinator began waiting for it
        self.history: list[StepRecord] = []
        self.first_steps: dict = {}  # member -> the step it is ready for first (its restored checkpoint)
        self.lost_now: list = []    # (group, why) lost during the step being tried
        self.finals: dict = {}      # member -> its final result
        self.heal_log: list = []    # (step, group, member, donor, donor group, bytes, seconds)
        self.events: list = []      # (time, "lost" | "healed", group, what)
        self.tried: dict = {}       # (group, incarnation) -> donor groups that could not reach it
        self.error: LiveError | None = None   # LastGroupLost, or another reason the job cannot go on
        self.errors: dict = {}      # member -> its error report in the attempt being tried
        self.done = False
        self.last_set = None

    # -- helpers -------------------------------------------------------------------------------
    def active(self) -> list[int]:
        return sorted(g for g, inc in self.groups.items() if inc.state == "active")

    def members_of(self, groups) -> list[int]:
        return [m for g in groups for m in self.groups[g].members if m is not None]

    def live_members(self) -> list[int]:
        return [m for inc in self.groups.values() if inc.state != "lost"
                for m in inc.members if m is not None]

    def _owe(self, members) -> None:
        t = self.now()
        for m in members:
            self.owed[m] = t

    # -- events --------------------------------------------------------------------------------
    def register(self, member: int, group: int, pos: int) -> None:
        """Member ``member`` starts as position ``pos`` of replica group ``group`` (a replacement when
        the group's current incarnation was lost)."""
        if not (0 <= group < self.G and 0 <= pos < self.k):  # refused to it; the job goes on
            self.send(member, ("fatal", f"member {member}: group {group}, position {pos} is not in the job's "
                                        f"{self.G} groups of {self.k}", None, None))
            return
        inc = self.groups[group]
        if inc.state == "lost":
            inc = self.groups[group] = Incarnation(group, inc.number + 1, [None] * self.k)
        if inc.members[pos] is not None or inc.state not in ("joining",):
            self.send(member, ("fatal", f"group {group} position {pos} is taken by member "
                                        f"{inc.members[pos]} (incarnation {inc.number})", None, None))
            return
        inc.members[pos] = member
        self.where[member] = (inc, pos)
        self.beats[member] = (self.now(), "ready", self.step)
        if None not in inc.members:  # complete: the original groups start together, a replacement heals
            inc.state = "active" if inc.number == 0 else "complete"
            for m in inc.members:
                self.send(m, ("welcome", group, inc.number, list(inc.members)))
            self._owe(inc.members)  # each owes its "ready" once its model is built
        self._maybe_decide()

    def ready_for(self, member: int, step: int | None) -> None:
        """The member waits for the quorum of ``step`` (None: a replacement, whatever step is next)."""
        if member in self.where and self.where[member][0].state != "lost":
            self.ready.add(member)
            self.owed.pop(member, None)
            if step is not None and not self.history:
                self.first_steps[member] = step  # a job resumed from a checkpoint starts there
            self._maybe_decide()

    def exited(self, group: int, pos: int, incarnation: int, code: int) -> None:
        """A launcher saw the process of (group, pos, incarnation) end with status ``code``. If it never
        registered, nobody else will notice: an original group's is the end of the job (a worker that
        cannot start fails the same way again), a replacement's leaves its group out."""
        inc = self.groups.get(group)
        if inc is None or self.done:
            return
        never = incarnation > inc.number or (incarnation == inc.number and inc.state == "joining"
                                              and inc.members[pos] is None)
        if not never:
            return  # it registered: its closed link already said so
        why = (f"the process of group {group}, position {pos} (incarnation {incarnation}) ended with status "
               f"{code} before it registered")
        if incarnation == 0:
            self._fatal(why + " (see its error above)", lost=False)
            return
        if inc.state == "joining":
            inc.state = "lost"
        self.say(f"[quorum] {why}: its replacement is given up")

    def beat(self, member: int, phase: str, step: int) -> None:
        if member in self.where:
            self.beats[member] = (self.now(), phase, step)

    def report(self, member: int, step: int, attempt: int, ok: bool, error: str = "", healed: bool = False,
               unreachable=()) -> None:
        """A member's reduction of (step, attempt) ended: ``ok``, or ``error``; ``unreachable``: the
        healers this member (their donor) could not connect to."""
        if self.pending is None or (step, attempt) != (self.step, self.attempt) or member not in self.where:
            return  # a report of an attempt already replaced
        self.reports[member] = ok
        if error:
            self.errors.setdefault(member, error)
        self.owed.pop(member, None)
        if unreachable:
            self._unreachable(unreachable)
            return
        P, H = self.pending
        everyone = self.members_of(list(P) + list(H))
        if all(self.reports.get(m) for m in everyone):
            self._commit()
        elif all(m in self.reports for m in everyone):  # all answered, some failed, nobody lost: retry
            self.retries += 1
            first = next(iter(self.errors.values()), "")
            if self.retries > self.max_retries:
                self._fatal(f"the step failed {self.retries} times with every group alive: a bug or a broken "
                            f"link, not a lost replica", f"last error: {first}", lost=False)
                return
            self._new_attempt(f"a reduction failed without a lost member ({first}); trying again")

    def healed(self, member: int, step: int, donor: int, donor_group: int, nbytes: int,
               seconds: float) -> None:
        """A healer's state arrived (its step goes on): said, and kept in ``heal_log``."""
        g = self.where[member][0].group if member in self.where else "?"
        self.heal_log.append((step, g, member, donor, donor_group, nbytes, seconds))
        self.events.append((self.now(), "healed", g, f"from group {donor_group}"))
        self.say(f"[heal] step {step}: group {g} member {member} took {nbytes} bytes of state from member "
                 f"{donor} (group {donor_group}) in {seconds * 1e3:.1f} ms")

    def finished(self, member: int, result) -> None:
        """After the last step each member of an active group sends its result."""
        self.finals[member] = result
        self.owed.pop(member, None)
        self._check_done()

    def _check_done(self) -> None:
        if self.step >= self.steps and self.pending is None and not self.done and \
                all(m in self.finals for m in self.members_of(self.active())):
            self.done = True
            for m in self.live_members():
                if m not in self.finals:
                    self.send(m, ("finish",))

    def lost(self, member: int, why: str) -> None:
        """Member ``member`` failed (its link closed, its launcher saw it die, or it hung): its whole
        group leaves; the step in progress goes on without it."""
        if member not in self.where or self.done or member in self.finals:
            return
        inc = self.where[member][0]
        if inc.state != "lost":
            self._drop(inc, f"member {member} {why}")

    def _drop(self, inc: Incarnation, why: str, replace: bool = True, retry: bool = True) -> None:
        was, g = inc.state, inc.group
        inc.state = "lost"
        members = [m for m in inc.members if m is not None]
        for m in members:
            self.ready.discard(m)
            self.owed.pop(m, None)
        for m in self.live_members():
            for gone in members:
                self.send(m, ("lost", gone, why))
            self.send(m, ("revoke", ("g", g, inc.number)))
        for m in members:
            self.send(m, ("leave", f"group {g} left the quorum: {why}"))
        self.lost_now.append((g, why))
        self.events.append((self.now(), "lost", g, why))
        if replace and self.replace is not None and not self.done:
            self.replace(g)
        if self.pending is not None and (g in self.pending[0] or g in self.pending[1]):
            if retry:
                self._new_attempt(f"group {g} lost ({why})", lost=(g, why))
        elif was in ("active", "healing"):
            self.say(f"[quorum] group {g} lost before step {self.step} ({why})")
            self._maybe_decide()
            self._check_done()

    def _unreachable(self, healers) -> None:
        """A donor could not reach these healers: each tries the next participant; one that no
        participant can reach cannot heal (``NoLivePeer`` on its members), the others go on."""
        P, H = self.pending
        for u in healers:
            inc = self.where[u][0] if u in self.where else None
            if inc is None or inc.state != "healing":
                continue
            tried = self.tried.setdefault((inc.group, inc.number), set())
            tried.add(H[inc.group])
            left = [g for g in P if g not in tried]
            if left:
                H[inc.group] = left[0]
                continue
            msg = (f"replacement group {inc.group} (members {inc.members}) could not be reached by any live "
                   f"peer (donor groups tried: {sorted(tried)}): it cannot heal; check that its host accepts "
                   f"connections, then start it again")
            for m in inc.members:
                self.send(m, ("nopeer", msg))
            self._drop(inc, "unreachable: no live peer could connect to it", replace=False, retry=False)
        self._new_attempt(f"a donor could not reach healer members {list(healers)}")

    def tick(self) -> None:
        """Call every so often: a member the coordinator waits for, silent for more than
        ``hang_timeout`` seconds, is hung -- of several, the one that got least far."""
        if self.done:
            return
        t = self.now()
        stale = {m: t - max(since, self.beats.get(m, (0.0,))[0]) for m, since in self.owed.items()}
        stale = {m: age for m, age in stale.items() if age > self.hang_timeout}
        if stale:
            def progress(m):
                _, phase, step = self.beats.get(m, (0.0, "ready", -1))
                return (step, PHASES.index(phase), -stale[m])
            m = min(stale, key=progress)
            _, phase, step = self.beats.get(m, (0.0, "ready", -1))
            self.lost(m, f"hung: no heartbeat for {stale[m]:.1f} s (last: {phase} of step {step})")

    # -- decisions -----------------------------------------------------------------------------
    def _maybe_decide(self) -> None:
        if self.pending is not None or self.done or self.error is not None:
            return
        if any(inc.number == 0 and inc.state == "joining" for inc in self.groups.values()):
            return  # the original groups start together
        P = self.active()
        if not P:
            self._fatal("no replica group is left", "; ".join(w for _, w in self.lost_now))
            return
        if not all(m in self.ready for m in self.members_of(P)):
            return
        if not self.history and self.first_steps:  # the first step: where every group resumed
            first = {self.first_steps.get(m) for m in self.members_of(P)}
            if len(first) != 1:
                self._fatal(f"the groups resumed from different steps {sorted(first, key=str)}", lost=False)
                return
            self.step = first.pop()
            self.first_steps = {}
        if self.step >= self.steps:
            return  # training is over: the members send their results
        H = {g: P[0] for g, inc in self.groups.items()
             if inc.state == "complete" and all(m in self.ready for m in self.members_of([g]))
             and (self.heal_when is None or self.heal_when(self.step))}
        for g in H:
            self.groups[g].state = "healing"
        self.pending, self.attempt, self.retries, self.reports, self.lost_now = (tuple(P), H), 0, 0, {}, []
        self.errors = {}
        self.t_step = self.now()
        self._announce()
        self._send_quorum()

    def _announce(self) -> None:
        P, H = self.pending
        now = (P, tuple(sorted(H)))
        if now != self.last_set:
            heal = "".join(f"; group {h} heals from group {d}" for h, d in sorted(H.items()))
            self.say(f"[quorum] step {self.step}: groups {list(P)} of {self.G} take part (effective batch "
                     f"{len(P) * self.rows} rows of {self.G * self.rows}){heal}")
            self.last_set = now

    def _send_quorum(self) -> None:
        P, H = self.pending
        table = {g: list(self.groups[g].members) for g in list(P) + list(H)}
        saver = P[0]
        msg = ("quorum", self.step, self.attempt, list(P), dict(H), table, saver)
        for m in self.members_of(list(P) + list(H)):
            self.send(m, msg)
        self._owe(self.members_of(list(P) + list(H)))

    def _new_attempt(self, why: str, lost: tuple | None = None) -> None:
        P, H = self.pending
        for m in self.live_members():
            self.send(m, ("revoke", ("q", self.step, self.attempt)))
        P = tuple(g for g in P if self.groups[g].state == "active")
        if not P:
            self._fatal(f"replica group {lost[0]}, the last one left, was lost" if lost else why,
                        lost[1] if lost else "")
            return
        H = {h: (d if d in P else P[0]) for h, d in H.items() if self.groups[h].state == "healing"}
        self.pending, self.reports, self.errors = (P, H), {}, {}
        self.attempt += 1
        self.say(f"[quorum] step {self.step}, attempt {self.attempt}: {why}; groups {list(P)} finish the step"
                 + "".join(f"; group {h} heals from group {d}" for h, d in sorted(H.items())))
        self.last_set = (P, tuple(sorted(H)))
        self._send_quorum()

    def _commit(self) -> None:
        P, H = self.pending
        for m in self.members_of(list(P) + list(H)):
            self.send(m, ("commit", self.step, self.attempt))
        for h in H:
            self.groups[h].state = "active"
        self.history.append(StepRecord(self.step, P, dict(H), self.attempt + 1, list(self.lost_now),
                                       self.t_step, self.now()))
        self.step += 1
        took = set(self.members_of(list(P) + list(H)))
        self.pending, self.reports = None, {}
        self.ready = {m for m in self.ready if m not in took}  # a replacement waiting to heal stays ready
        self._owe(self.members_of(list(P) + list(H)))  # each owes its "ready" for the next step
        if self.step >= self.steps:
            self.owed.clear()
        self._maybe_decide()

    def _fatal(self, what: str, why: str = "", lost: bool = True) -> None:
        """End the job: ``LastGroupLost`` (``lost``: no live peer holds the state), else ``LiveError``;
        either names the checkpoint to restart from."""
        ckpt = self.checkpoint() if self.checkpoint is not None else None
        where = (f"restart the job from its checkpoint of step {ckpt} (python -m minidist.launch restarts "
                 f"it)" if ckpt is not None else "no checkpoint was saved: the job starts again from step 0")
        msg = (f"step {self.step}: {what}" + (f" ({why})" if why else "")
               + ("; no live peer holds the state" if lost else "") + f": {where}")
        self.error = LastGroupLost(msg, self.step, ckpt) if lost else LiveError(msg)
        self.say(f"[quorum] FATAL {msg}")
        self.done = True
        for m in self.live_members():
            self.send(m, ("fatal", msg, self.step if lost else None, ckpt))
