"""The live faults' spec: parsed, refused with the part and what would be right, matched to one member."""

import pytest

from minidist.resilience.live.faults import Killed, LiveInjector, parse


def test_a_spec_parses_into_faults_and_defaults():
    a, b, c = parse("kill:group=1,step=5; hang:group=2,step=3,pos=1,phase=reduce;"
                    "unreachable:group=1,incarnation=1")
    assert (a.kind, a.group, a.step, a.pos, a.incarnation, a.phase) == ("kill", 1, 5, 0, 0, "compute")
    assert (b.kind, b.pos, b.phase) == ("hang", 1, "reduce")
    assert (c.kind, c.incarnation, c.step) == ("unreachable", 1, None)
    assert parse("") == parse(None) == []


@pytest.mark.parametrize("spec,words", [
    ("crash:group=1", ["unknown kind 'crash'", "kill, hang, unreachable"]),
    ("kill:rank=1", ["bad argument 'rank=1'", "group=G"]),
    ("kill:group=1,phase=later", ["phase='later'", "compute, reduce, commit, donate"]),
])
def test_a_bad_spec_names_the_part_and_what_would_be_right(spec, words):
    with pytest.raises(ValueError) as e:
        parse(spec)
    for w in words:
        assert w in str(e.value)


def test_an_injector_fires_for_its_member_step_and_phase_only():
    faults = parse("kill:group=1,step=2,pos=1;kill:group=0,phase=donate")
    mine = LiveInjector(faults, 1, 1, 0, process=False)
    other = LiveInjector(faults, 1, 1, 1, process=False)   # the replacement: another incarnation
    mine.at(1, "compute")
    mine.at(2, "reduce")
    with pytest.raises(Killed):
        mine.at(2, "compute")
    other.at(2, "compute")
    donor = LiveInjector(faults, 0, 0, 0, process=False)
    with pytest.raises(Killed):
        donor.at(7, "donate")   # no step: the first time its phase comes
