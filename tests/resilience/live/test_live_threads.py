"""Live recovery on the threads transport, property-tested against its twins.

A run with a failure -- drawn: the kill step, the group killed, its member, the phase it dies in, the
number of groups and the mesh inside a group -- must equal, bit for bit in float64,

* the serial twin given the same quorum sequence (``quorum_twin``: one GPT, per committed step the
  participants' gradients summed in group order, divided by their number) where a group computes
  exactly as one process does (no mesh, or a pipeline of one microbatch);
* with tensor parallelism inside a group, the *group twin*: one failure-free TP group computing each
  participant's gradient in turn on the same rows, summed in group order (the serial GPT differs from
  TP by the order row-parallel partial products add up: 1e-14, checked to 1e-10);

and every group alive at the end -- survivors and healed replacements -- holds the same state at every
position: parameters, AdamW's m and v, step count, data position, RNG stream.
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist.autograd import random as mrandom
from minidist.comm import run, world
from minidist.lessons.live_recovery_job import (
    LiveGPTJob,
    LiveLocalSGDJob,
    live_config,
    local_sgd_twin,
    quorum_twin,
)
from minidist.parallel.data.live.quorum_ddp import StaticView
from minidist.resilience.live import run_threads
from tests.conftest import budget

ROWS, STEPS = 2, 6
MESHES = {"none": (1, 1), "pp2": (2, 1), "tp2": (1, 2)}   # (pp, tp) inside a group


def _run(groups, mesh, faults, steps=STEPS, **kw):
    pp, tp = MESHES[mesh]
    cfg = live_config(dropout=0.1 if mesh == "none" else 0.0)
    run_ = run_threads(lambda g, pos: LiveGPTJob(cfg, g, pos, groups, ROWS, pp=pp, tp=tp), groups, pp * tp,
                       steps, faults=faults, hang_timeout=kw.pop("hang_timeout", 5.0), rows=ROWS,
                       say=lambda s: None, **kw)
    return cfg, run_


def _same_state_everywhere(finals):
    """Every group alive at the end holds, position by position, the same arrays and replicated state."""
    by_pos = {}
    for f in finals:
        by_pos.setdefault(f["pos"], []).append(f)
    for pos, fs in by_pos.items():
        a = fs[0]
        for b in fs[1:]:
            assert a["arrays"].keys() == b["arrays"].keys()
            for name in a["arrays"]:
                assert np.array_equal(a["arrays"][name], b["arrays"][name]), \
                    f"position {pos}: {name} of group {b['group']} differs from group {a['group']}'s"
            for key in ("optimizer", "objects"):
                assert a["small"][key] == b["small"][key], (pos, key)
            assert a["small"]["rngs"]["job"] == b["small"]["rngs"]["job"], pos
    return len(by_pos[0])


class _Captured(BaseException):
    pass


class _GroupTwinQuorum:
    """The group twin's quorum: while capturing, ``fn`` sees this group alone (n = 1: its own gradient,
    exactly) and the step is abandoned before the optimizer; then it hands out the average."""

    def __init__(self):
        self.one, self.average = None, None

    def reduce(self, fn):
        if self.average is None:
            raise _Captured(fn(StaticView(self.one, self.one, 1)))
        return self.average


def group_twin(cfg, history, groups, tp):
    """One failure-free TP group computes each participant's gradient in turn; the twin of a live run
    with TP inside its groups."""
    def fn(comm):
        quorum = _GroupTwinQuorum()
        quorum.one = world()
        job = LiveGPTJob(cfg, 0, comm.rank, groups, ROWS, tp=tp)
        job.build(comm, quorum)
        for rec in history:
            x, y = job.loader.next_batch()
            seed = int(job.rng.integers(2 ** 62))
            total = None
            for g in sorted(rec.participants):
                mrandom.manual_seed([seed, g])
                quorum.average = None
                try:
                    job.par.step(x[g * ROWS:(g + 1) * ROWS], y[g * ROWS:(g + 1) * ROWS])
                except _Captured as c:
                    flats = c.args[0]
                job.par.optimizer.zero_grad()
                total = flats if total is None else [a + b for a, b in zip(total, flats)]
            quorum.average = [t / len(rec.participants) for t in total]
            job.par.optimizer_step()
        return job.result()["full"]
    return run(fn, ranks=tp)[0]


@budget(8)
@given(groups=st.integers(2, 4), mesh=st.sampled_from(sorted(MESHES)), step=st.integers(0, STEPS - 2),
       data=st.data())
def test_a_run_with_a_failure_equals_its_twin_given_the_same_quorum_sequence(groups, mesh, step, data):
    pp, tp = MESHES[mesh]
    if pp * tp > 1:
        groups = min(groups, 3)
    victim = data.draw(st.integers(0, groups - 1), label="group killed")
    pos = data.draw(st.integers(0, pp * tp - 1), label="its member")
    phase = data.draw(st.sampled_from(["compute", "reduce", "commit"]), label="phase")
    cfg, r = _run(groups, mesh, f"kill:group={victim},step={step},pos={pos},phase={phase}")
    assert r.error is None, r.error
    assert [rec.step for rec in r.history] == list(range(STEPS))  # every step committed once, in order
    assert all(victim in rec.participants for rec in r.history[:step])
    assert victim not in r.history[step + 1].participants  # it left; a replacement takes part after healing
    assert [h for rec in r.history for h in rec.healing] in ([], [victim])
    finals = [f for f in r.finals.values()]
    last = r.history[-1]
    assert _same_state_everywhere(finals) == len(last.participants) + len(last.healing)
    if mesh == "tp2":
        want = group_twin(cfg, r.history, groups, tp)
        serial = quorum_twin(cfg, r.history, groups, ROWS)
        assert max(float(np.max(np.abs(want[k] - serial[k]))) for k in serial) < 1e-10
    else:
        want = quorum_twin(cfg, r.history, groups, ROWS)
    for f in finals:
        if f["full"] is not None:
            for name in want:
                assert np.array_equal(f["full"][name], want[name]), (f["group"], name)


def test_the_replacement_heals_rejoins_and_equals_the_survivors():
    cfg, r = _run(3, "none", "kill:group=1,step=1", steps=12)
    healed = [(rec.step, rec.healing) for rec in r.history if rec.healing]
    assert len(healed) == 1 and healed[0][1] == {1: 0}
    s = healed[0][0]
    assert r.history[s].participants == (0, 2) and r.history[s + 1].participants == (0, 1, 2)
    assert len(r.heals) == 1 and r.heals[0][1] == 1 and r.heals[0][4] == 0
    assert r.lives[1][0][2].startswith("killed") and r.lives[1][1][2] == "finished"
    assert all(len(r.lives[slot]) == 1 for slot in (0, 2))   # the survivors' threads never changed
    assert _same_state_everywhere(list(r.finals.values())) == 3
    want = quorum_twin(cfg, r.history, 3, ROWS)
    for f in r.finals.values():
        assert all(np.array_equal(f["full"][k], want[k]) for k in want)


def test_a_hung_member_is_caught_by_its_heartbeat_and_the_others_finish_the_step():
    cfg, r = _run(3, "none", "hang:group=2,step=2", hang_timeout=1.0)
    assert r.error is None
    assert r.history[2].participants == (0, 1) and r.history[2].attempts == 2
    assert "hung: no heartbeat" in r.history[2].lost[0][1]
    want = quorum_twin(cfg, r.history, 3, ROWS)
    for f in r.finals.values():
        assert all(np.array_equal(f["full"][k], want[k]) for k in want)


def test_a_failure_during_a_heal_is_retried_from_another_donor():
    """The donor dies as it starts sending its state: the heal is tried again from another group."""
    cfg, r = _run(3, "none", "kill:group=1,step=1;kill:group=0,phase=donate", steps=12)
    assert r.error is None
    heal_steps = [rec for rec in r.history if rec.healing]
    first = heal_steps[0]
    assert first.healing == {1: 2} and first.attempts == 2 and first.participants == (2,)
    assert _same_state_everywhere(list(r.finals.values())) >= 2
    want = quorum_twin(cfg, r.history, 3, ROWS)
    for f in r.finals.values():
        assert all(np.array_equal(f["full"][k], want[k]) for k in want)


@budget(6)
@given(groups=st.integers(2, 4), H=st.sampled_from([2, 3]), step=st.integers(0, 7), data=st.data())
def test_diloco_over_the_quorum_equals_its_twin(groups, H, step, data):
    """LocalSGD / DiLoCo: an outer step over the groups present; a replacement heals at a sync step."""
    victim = data.draw(st.integers(0, groups - 1), label="group killed")
    phase = data.draw(st.sampled_from(["compute", "reduce"]), label="phase")
    cfg = live_config(dropout=0.1)
    r = run_threads(lambda g, pos: LiveLocalSGDJob(cfg, g, pos, groups, ROWS, H=H), groups, 1, 12,
                    faults=f"kill:group={victim},step={step},phase={phase}", rows=ROWS, say=lambda s: None,
                    heal_when=lambda s: (s + 1) % H == 0)
    assert r.error is None
    assert all((rec.step + 1) % H == 0 for rec in r.history if rec.healing)
    want = local_sgd_twin(cfg, r.history, groups, ROWS, H=H)
    for f in r.finals.values():
        for name, v in want[f["group"]].items():
            assert np.array_equal(f["full"][name], v), (f["group"], name)
    outer = [{k: v for k, v in f["arrays"].items() if k.startswith("outer/")} for f in r.finals.values()]
    assert all(o.keys() == outer[0].keys() and all(np.array_equal(o[k], outer[0][k]) for k in o)
               for o in outer)


@pytest.mark.parametrize("mesh", ["pp2", "tp2"])
def test_a_group_with_a_mesh_inside_loses_every_member_when_one_dies(mesh):
    cfg, r = _run(2, mesh, "kill:group=0,step=2,pos=1", steps=8)
    assert r.error is None and r.history[2].participants == (1,)
    assert r.lives[0][0][2].startswith("left")  # its group-mate: "left the quorum", or "left (RankExited..."
    assert r.lives[1][0][2].startswith("killed")
