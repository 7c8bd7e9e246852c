"""Checkpoints stay for the failure of the whole job: the lowest participating group saves them (through
the checkpoint tiers), the last group lost is an error naming the step and the checkpoint, and a
restart from that checkpoint finishes the run as if the two runs were one -- bit for bit against the
serial twin of the joined quorum sequence."""

import numpy as np
import pytest

from minidist.lessons.live_recovery_job import LiveGPTJob, live_config, quorum_twin
from minidist.resilience.attempts import newest_good_checkpoint
from minidist.resilience.checkpoint.tiers import Checkpointer, Tier
from minidist.resilience.live import LastGroupLost, run_threads

ROWS = 2


def _run(tmp_path, groups, steps, faults, resume=False, every=3):
    cfg = live_config(dropout=0.1)
    tiers = [Tier("memory", str(tmp_path / "mem"), every=every, keep=2),
             Tier("disk", str(tmp_path / "disk"), every=2 * every, keep=2)]
    return cfg, run_threads(lambda g, pos: LiveGPTJob(cfg, g, pos, groups, ROWS), groups, 1, steps,
                            faults=faults, rows=ROWS, say=lambda s: None, resume=resume,
                            checkpointer=lambda comm: Checkpointer(comm, tiers, asynchronous=False),
                            newest_checkpoint=lambda: newest_good_checkpoint(str(tmp_path / "mem"))[0])


def test_the_last_group_lost_names_the_step_and_the_checkpoint_and_a_restart_finishes_the_run(tmp_path):
    # group 0 dies at step 1 and its replacement heals; at step 5 both groups die: the replacement too
    cfg, first = _run(tmp_path / "b", 2, 10,
                      "kill:group=0,step=1;kill:group=0,step=5,incarnation=1;kill:group=1,step=5")
    e = first.error
    assert isinstance(e, LastGroupLost) and (e.step, e.checkpoint) == (5, 3), e
    assert "step 5:" in str(e) and "restart the job from its checkpoint of step 3" in str(e)
    assert [rec.step for rec in first.history] == [0, 1, 2, 3, 4]
    cfg, second = _run(tmp_path / "b", 2, 10, "", resume=True)
    assert second.error is None
    assert [rec.step for rec in second.history] == list(range(3, 10))   # resumed at the checkpoint
    want = quorum_twin(cfg, first.history[:3] + second.history, 2, ROWS)
    for f in second.finals.values():
        for name in want:
            assert np.array_equal(f["full"][name], want[name]), name


@pytest.mark.parametrize("faults", ["kill:group=0,step=2", ""])
def test_the_saving_group_is_the_lowest_participant_and_its_checkpoint_restores_exactly(tmp_path, faults):
    cfg, r = _run(tmp_path, 3, 7, faults)
    assert r.error is None
    assert newest_good_checkpoint(str(tmp_path / "mem"))[0] == 6
    assert newest_good_checkpoint(str(tmp_path / "disk"))[0] == 6
    cfg, again = _run(tmp_path, 3, 9, "", resume=True)
    assert [rec.step for rec in again.history] == [6, 7, 8]
    want = quorum_twin(cfg, r.history[:6] + again.history, 3, ROWS)
    for f in again.finals.values():
        assert all(np.array_equal(f["full"][k], want[k]) for k in want)
