"""The coordinator as a state machine, fed events by hand: what it sends, when, and what it records.

Every expected message is written out here from the protocol (quorum.py's docstring), not computed by
the code under test: 3 groups of 1 (members 10, 11, 12), then a replacement (member 20)."""


from minidist.resilience.live.errors import LastGroupLost, LiveError
from minidist.resilience.live.quorum import Coordinator


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def make(groups=3, k=1, steps=4, **kw):
    sent, said, clock = [], [], Clock()
    c = Coordinator(groups, k, steps, lambda m, msg: sent.append((m, msg)), say=said.append, now=clock,
                    rows=2, **kw)
    return c, sent, said, clock


def start(c, members=(10, 11, 12)):
    for g, m in enumerate(members):
        c.register(m, g, 0)
    for m in members:
        c.ready_for(m, 0)


def of_kind(sent, kind, member=None):
    return [msg for m, msg in sent if msg[0] == kind and (member is None or m == member)]


def test_the_first_quorum_waits_for_every_original_group_then_names_them_all():
    c, sent, said, _ = make()
    c.register(10, 0, 0)
    c.register(11, 1, 0)
    c.ready_for(10, 0)
    c.ready_for(11, 0)
    assert of_kind(sent, "quorum") == []  # group 2 has not registered: no step starts without it
    c.register(12, 2, 0)
    c.ready_for(12, 0)
    q = of_kind(sent, "quorum")
    assert len(q) == 3 and q[0] == ("quorum", 0, 0, [0, 1, 2], {}, {0: [10], 1: [11], 2: [12]}, 0)
    assert said == ["[quorum] step 0: groups [0, 1, 2] of 3 take part (effective batch 6 rows of 6)"]


def test_all_ok_commits_and_a_lost_group_makes_a_new_attempt_of_the_same_step_without_it():
    c, sent, said, _ = make()
    start(c)
    for m in (10, 11, 12):
        c.report(m, 0, 0, True)
    assert of_kind(sent, "commit") == [("commit", 0, 0)] * 3
    for m in (10, 11, 12):
        c.ready_for(m, 1)
    sent.clear()
    c.report(10, 1, 0, True)
    c.lost(11, "killed")
    # every live member hears of the loss and of the revoked communicators, then the new attempt
    assert ("lost", 11, "member 11 killed") in of_kind(sent, "lost", 10)
    assert of_kind(sent, "revoke", 12) == [("revoke", ("g", 1, 0)), ("revoke", ("q", 1, 0))]
    assert of_kind(sent, "quorum", 10) == [("quorum", 1, 1, [0, 2], {}, {0: [10], 2: [12]}, 0)]
    assert of_kind(sent, "quorum", 11) == []
    c.report(10, 1, 0, True)  # a report of the replaced attempt changes nothing
    assert of_kind(sent, "commit") == []
    c.report(10, 1, 1, True)
    c.report(12, 1, 1, True)
    assert of_kind(sent, "commit", 12) == [("commit", 1, 1)]
    rec = c.history[1]
    assert (rec.step, rec.participants, rec.attempts) == (1, (0, 2), 2)
    assert rec.lost == [(1, "member 11 killed")]
    assert said[-1] == ("[quorum] step 1, attempt 1: group 1 lost (member 11 killed); groups [0, 2] finish "
                        "the step")


def test_a_replacement_heals_from_the_lowest_participant_and_then_takes_part():
    replaced = []
    c, sent, said, _ = make(replace=replaced.append)
    start(c)
    c.lost(11, "killed")          # at the boundary of step 0: a new attempt of step 0
    assert replaced == [1]
    for m in (10, 12):
        c.report(m, 0, 1, True)
    c.register(20, 1, 0)          # the replacement: incarnation 1 of group 1
    assert of_kind(sent, "welcome", 20) == [("welcome", 1, 1, [20])]
    c.ready_for(20, None)
    for m in (10, 12):
        c.ready_for(m, 1)
    assert of_kind(sent, "quorum", 20)[-1] == ("quorum", 1, 0, [0, 2], {1: 0}, {0: [10], 2: [12], 1: [20]}, 0)
    c.healed(20, 1, 10, 0, 1234, 0.01)
    for m in (10, 12, 20):
        c.report(m, 1, 0, True)
    assert c.history[-1].healing == {1: 0}
    for m in (10, 12, 20):
        c.ready_for(m, 2)
    assert of_kind(sent, "quorum", 20)[-1][3] == [0, 1, 2]  # it takes part from the next step
    assert any("group 1 member 20 took 1234 bytes of state from member 10 (group 0)" in s for s in said)


def test_heal_when_holds_a_replacement_back_until_a_step_it_allows():
    c, sent, _, _ = make(steps=6, heal_when=lambda s: s % 3 == 2)
    start(c)
    c.lost(11, "killed")
    c.register(20, 1, 0)
    c.ready_for(20, None)
    step = 0
    for attempt in (1, 0):
        for m in (10, 12):
            c.report(m, step, attempt, True)
        step += 1
        for m in (10, 12):
            c.ready_for(m, step)
    assert of_kind(sent, "quorum", 20) == [("quorum", 2, 0, [0, 2], {1: 0}, {0: [10], 2: [12], 1: [20]}, 0)]


def test_the_last_group_lost_is_an_error_naming_the_step_and_the_checkpoint():
    c, sent, said, _ = make(groups=2, checkpoint=lambda: 4)
    start(c, (10, 11))
    c.lost(10, "killed")
    c.lost(11, "hung")
    assert isinstance(c.error, LastGroupLost) and c.done
    assert (c.error.step, c.error.checkpoint) == (0, 4)
    msg = str(c.error)
    assert msg.startswith("step 0: replica group 1, the last one left, was lost (member 11 hung)")
    assert "restart the job from its checkpoint of step 4" in msg
    no_ckpt, _, _, _ = make(groups=1)
    start(no_ckpt, (10,))
    no_ckpt.lost(10, "killed")
    assert "no checkpoint was saved: the job starts again from step 0" in str(no_ckpt.error)


def test_a_silent_member_is_blamed_the_least_advanced_of_those_it_waits_for():
    c, sent, _, clock = make(hang_timeout=2.0)
    start(c)
    clock.t = 1.0
    c.beat(10, "reduce", 0)
    c.beat(12, "reduce", 0)
    c.beat(11, "compute", 0)      # member 11 stops here
    clock.t = 2.5
    c.tick()
    assert of_kind(sent, "lost") == []  # nobody silent for 2 s yet
    clock.t = 4.0                 # all three silent for 3 s: 11 got least far
    c.tick()
    lost = {msg[1] for msg in of_kind(sent, "lost")}
    assert lost == {11}
    assert of_kind(sent, "leave") == [("leave", "group 1 left the quorum: member 11 hung: no heartbeat for "
                                                "3.0 s (last: compute of step 0)")]


def test_a_donor_that_cannot_reach_its_healer_hands_it_to_the_next_then_no_peer_is_named():
    c, sent, _, _ = make()
    start(c)
    c.lost(11, "killed")
    for m in (10, 12):
        c.report(m, 0, 1, True)
    c.register(20, 1, 0)
    c.ready_for(20, None)
    for m in (10, 12):
        c.ready_for(m, 1)
    c.report(10, 1, 0, False, "Unreachable", False, [20])
    assert of_kind(sent, "quorum", 20)[-1][4] == {1: 2}  # group 2 tries next
    c.report(12, 1, 1, False, "Unreachable", False, [20])
    nopeer = of_kind(sent, "nopeer", 20)
    assert len(nopeer) == 1
    assert "could not be reached by any live peer (donor groups tried: [0, 2])" in nopeer[0][1]
    assert of_kind(sent, "quorum", 10)[-1][:5] == ("quorum", 1, 2, [0, 2], {})  # the step goes on without it


def test_a_registration_for_a_taken_position_is_refused():
    c, sent, _, _ = make()
    start(c)
    c.register(30, 0, 0)
    assert of_kind(sent, "fatal", 30)[0][1].startswith("group 0 position 0 is taken by member 10")
    c.register(31, 5, 0)
    assert of_kind(sent, "fatal", 31)[0] == ("fatal", "member 31: group 5, position 0 is not in the job's 3 "
                                                      "groups of 1", None, None)
    assert c.error is None and c.groups[0].members == [10]


def test_results_end_the_job_and_a_waiting_replacement_is_told_to_finish():
    c, sent, _, _ = make(steps=1)
    start(c)
    c.lost(12, "killed")
    for m in (10, 11):
        c.report(m, 0, 1, True)
    c.register(20, 2, 0)
    c.ready_for(20, None)
    c.finished(10, "r10")
    assert not c.done
    c.finished(11, "r11")
    assert c.done and of_kind(sent, "finish", 20) == [("finish",)]
    c.lost(10, "ended")  # its process exits after sending its result: not a failure
    assert c.groups[0].state == "active"


def test_a_failed_reduction_with_every_group_alive_is_tried_again_then_is_an_error():
    c, sent, said, _ = make(max_retries=2)
    start(c)
    for attempt in range(3):
        for m in (10, 11, 12):
            c.report(m, 0, attempt, m != 11, "CommTimeout: watchdog" if m == 11 else "")
        if attempt < 2:
            assert of_kind(sent, "quorum", 10)[-1][:4] == ("quorum", 0, attempt + 1, [0, 1, 2])
    assert type(c.error) is LiveError and "the step failed 3 times with every group alive" in str(c.error)
    assert "last error: CommTimeout: watchdog" in str(c.error)


def test_groups_resumed_from_a_checkpoint_start_there_and_must_agree():
    c, sent, _, _ = make(steps=10)
    for g, m in enumerate((10, 11, 12)):
        c.register(m, g, 0)
    for m in (10, 11, 12):
        c.ready_for(m, 6)
    assert of_kind(sent, "quorum", 10)[0][:3] == ("quorum", 6, 0)
    d, _, _, _ = make(steps=10)
    for g, m in enumerate((10, 11, 12)):
        d.register(m, g, 0)
    for m, s in ((10, 6), (11, 6), (12, 3)):
        d.ready_for(m, s)
    assert "the groups resumed from different steps [3, 6]" in str(d.error)


def test_a_process_that_ends_before_it_registers_is_named_not_waited_for():
    c, sent, said, _ = make()
    c.register(10, 0, 0)
    c.register(11, 1, 0)
    c.exited(1, 0, 0, 1)    # registered: its link says it, nothing here
    assert c.error is None
    c.exited(2, 0, 0, 1)    # never registered: the job cannot start
    assert type(c.error) is LiveError
    assert "the process of group 2, position 0 (incarnation 0) ended with status 1 before it registered" \
        in str(c.error)
    d, _, said, _ = make(replace=lambda g: None)
    start(d)
    d.lost(11, "killed")
    d.exited(1, 0, 0, -9)   # the killed one: its link said it already
    assert "given up" not in said[-1]
    d.exited(1, 0, 1, 1)    # its replacement died before registering: the group stays out, the job goes on
    assert d.error is None and "its replacement is given up" in said[-1]
