"""One member of a live job: its loop over steps, and the quorum it hands to data parallelism.

The member is handed a *job* (resilience knows no technique), with:

* ``build(group_comm, quorum)`` -- build the replica group's model on its communicator, handing
  ``quorum`` (this member) to data parallelism: its ``reduce(fn)`` runs the step's reduction;
* ``state`` -- the ``TrainState`` a heal moves; ``start_step`` -- 0, or a restored checkpoint's step;
* ``begin_step(step) -> batch`` -- the step's bookkeeping every replica does alike (data, RNG);
* ``train_step(batch)`` -- forward, backward, ``quorum.reduce``, the optimizer step;
* ``receive_step()`` -- a healer's step: ``quorum.reduce`` (it receives the average), the optimizer step;
* ``result()`` -- collective over the group, what it reports at the end; optionally
  ``committed(step, participants)`` -- told each committed step's participating groups.

Per step the member waits for the coordinator's quorum. A participant records its small state (the
heal's start-of-step state), starts sending its state to any healer it donates to, runs the step.
``reduce(fn)`` runs ``fn(view)`` -- ``view``: this position's communicators for the attempt -- and
reports; a new attempt (a group failed) runs it again on new communicators, until the commit. A healer
first takes the state from its donor (heal.py), then does the step's bookkeeping, then receives.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from minidist.comm.requests import CommError
from minidist.resilience.live.errors import GroupLeft, LastGroupLost, LiveError, NoLivePeer, Unreachable
from minidist.resilience.live.heal import pack_state, recv_state, send_packed


@dataclass
class ReplicaView:
    """What one attempt's reduction runs on, at this member's position in its group."""
    participants: object    # the participating groups' members here, in group order (None on a healer)
    everyone: object        # the participants, then the healers
    n: int                  # participating groups
    step: int
    attempt: int


class LiveMember:
    """One rank of a live job (see the module docstring). ``make_comm(members, ctx)`` builds a
    communicator of the fabric; ``checkpoint(group_comm)``: a ``Checkpointer`` for the whole job's
    failure (its tiers say when), saved by the lowest participating group; ``resume``: the original
    groups first restore its newest checkpoint (a restart after the whole job failed)."""

    def __init__(self, link, member: int, make_comm, group: int, pos: int, job, steps: int, *,
                 faults=None, checkpoint=None, resume: bool = False, address=None,
                 wait_timeout: float = 300.0):
        self.link, self.member, self.make_comm = link, member, make_comm
        self.group, self.pos, self.job, self.steps = group, pos, job, steps
        self.faults, self.checkpoint, self.address, self.resume = faults, checkpoint, address, resume
        self.wait_timeout = wait_timeout
        self.step = None
        self.healer = self.healed = False
        self.heals: list = []        # (step, donor member, bytes, seconds) of this member's heal
        self.donated: list = []      # (step, healer member, bytes)
        self.checkpointer = None
        self.s, self._donations, self.packed = None, [], None

    # -- messages --------------------------------------------------------------------------------
    def beat(self, phase: str) -> None:
        self.link.send(("beat", phase, self.s))

    def _next(self, what: str):
        msg = self.link.recv(self.wait_timeout, what)
        if msg[0] == "leave":
            raise GroupLeft(msg[1])
        if msg[0] == "fatal":
            raise LastGroupLost(msg[1], msg[2], msg[3]) if msg[2] is not None else LiveError(msg[1])
        if msg[0] == "nopeer":
            raise NoLivePeer(msg[1])
        return msg

    def _fault(self, phase: str) -> None:
        if self.faults is not None:
            self.faults.at(self.s, phase)

    # -- the loop --------------------------------------------------------------------------------
    def run(self):
        """Register, build, then one step per quorum until the last; returns the job's result."""
        self.link.send(("register", self.group, self.pos, self.address))
        msg = self._next(f"the other members of group {self.group} to register")
        _, _, self.incarnation, members = msg
        self.group_comm = self.make_comm(members, ("g", self.group, self.incarnation))
        self.job.build(self.group_comm, self)
        start = self.job.start_step
        if self.incarnation == 0 and self.checkpoint is not None and self.resume:
            self.checkpointer = self.checkpoint(self.group_comm)
            info, tier = self.checkpointer.restore(self.job.state)  # every group, from the same files
            start = info.step if info.step is not None else start
        self.s = self.step = start if self.incarnation == 0 else None
        self.link.send(("ready", self.step))
        while True:
            msg = self._next(f"the quorum of step {self.step}")
            if msg[0] == "finish":
                return None
            if msg[0] != "quorum":
                continue
            self._run_step(msg)
            if self.step >= self.steps:
                result = self.job.result()
                self.link.send(("done", result))
                return result
            self.link.send(("ready", self.step))

    def _adopt(self, msg) -> None:
        _, self.s, self.attempt, self.P, self.H, self.table, self.saver = msg[:7]
        if self.group not in self.P and self.group not in self.H:
            raise GroupLeft(f"group {self.group} is not in step {self.s}'s quorum {self.P}")

    def _run_step(self, msg) -> None:
        self._adopt(msg)
        self.healer, self.healed = self.group in self.H, False
        if self.healer:
            self.job.receive_step()
        else:
            self.small = self.job.state.small_state()  # what a healer starts this step from
            # with a healer, every participant copies its state now (any of them may become the donor):
            # the step changes it (an inner optimizer step happens before the reduction in LocalSGD)
            self.packed = pack_state(self.job.state, self.small) if self.H else None
            self._donate()
            self.beat("compute")
            self._fault("compute")
            self.job.train_step(self.job.begin_step(self.s))
        if hasattr(self.job, "committed"):  # the job may keep its quorum sequence (saved with it)
            self.job.committed(self.s, self.P)
        self.step = self.s + 1
        if self.checkpoint is not None and self.saver == self.group:
            if self.checkpointer is None:
                self.checkpointer = self.checkpoint(self.group_comm)
            self.checkpointer.maybe_save(self.step, self.job.state)

    # -- the quorum handed to data parallelism -----------------------------------------------------
    def view(self) -> ReplicaView:
        """This attempt's communicators at this member's position: participants, then healers."""
        s, a, j = self.s, self.attempt, self.pos
        part = [self.table[g][j] for g in self.P]
        heal = [self.table[h][j] for h in sorted(self.H)]
        mine = self.member in part
        return ReplicaView(self.make_comm(part, ("q", s, a, j, "p")) if mine else None,
                           self.make_comm(part + heal, ("q", s, a, j)), len(part), s, a)

    def reduce(self, fn):
        """Run ``fn(view)`` for this step until the coordinator commits it; returns its result. A new
        attempt (a group failed) runs it again on the groups left; a healer heals first."""
        while True:
            ok, err, unreachable, out = True, "", [], None
            try:
                if self.healer and not self.healed:
                    self._heal()
                self.beat("reduce")
                self._fault("reduce")
                out = fn(self.view())
                err, unreachable = self._join_donations()
                ok = not err
            except CommError as e:
                ok, err = False, f"{type(e).__name__}: {str(e).splitlines()[0]}"
                unreachable = self._join_donations()[1]
            self.link.send(("report", self.s, self.attempt, ok, err, self.healed, unreachable))
            self._fault("commit")
            while True:
                msg = self._next(f"the commit of step {self.s}")
                if msg[0] == "commit" and tuple(msg[1:3]) == (self.s, self.attempt):
                    return out
                if msg[0] == "quorum":
                    self._adopt(msg)
                    self._donate()
                    break

    # -- healing -------------------------------------------------------------------------------
    def _heal(self) -> None:
        donor_group = self.H[self.group]
        donor = self.table[donor_group][self.pos]
        comm = self.make_comm([donor, self.member], ("q", self.s, self.attempt, "heal", self.pos))
        self.beat("heal")
        t0 = time.perf_counter()
        nbytes = recv_state(comm, 0, self.job.state, who=f"member {donor} (group {donor_group})")
        self.job.begin_step(self.s)   # the step's bookkeeping, from the donor's start-of-step state
        self.healed = True
        seconds = time.perf_counter() - t0
        self.heals.append((self.s, donor, nbytes, seconds))
        self.link.send(("healed", self.s, donor, donor_group, nbytes, seconds))

    def _donate(self) -> None:
        """Start sending this member's state to each healer it is the donor of (in the background:
        the donor's own step goes on)."""
        self._join_donations()  # an earlier attempt's, if any
        for h, d in sorted(self.H.items()):
            if d != self.group:
                continue
            self._fault("donate")
            healer = self.table[h][self.pos]
            comm = self.make_comm([self.member, healer], ("q", self.s, self.attempt, "heal", self.pos))
            packed, box = self.packed or pack_state(self.job.state, self.small), {}

            def send(comm=comm, box=box, healer=healer, packed=packed):
                try:
                    box["bytes"] = send_packed(comm, 1, packed)
                    self.donated.append((self.s, healer, box["bytes"]))
                except CommError as e:
                    box["error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
                    box["unreachable"] = isinstance(e, Unreachable)
            t = threading.Thread(target=send, daemon=True, name=f"live-donate-{self.member}")
            t.start()
            self._donations.append((t, box, healer))

    def _join_donations(self) -> tuple[str, list]:
        """(errors, the healers that could not be reached) of this attempt's donations, once sent."""
        errors, unreachable = [], []
        for t, box, healer in self._donations:
            t.join()
            if "error" in box:
                errors.append(box["error"])
            if box.get("unreachable"):
                unreachable.append(healer)
        self._donations = []
        return "; ".join(errors), unreachable
