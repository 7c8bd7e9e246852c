"""Fault injection does what it says, at every step it claims and at no other: the sleep, the kill,
the exception, the disk-full error, the corruption and the truncation, observed through recorded calls
and the files themselves."""

import errno
import os

import pytest

from minidist.resilience import faults
from minidist.resilience.faults import InjectedFault, Injector, parse


def _injector(spec, rank=1):
    return Injector(rank, [f for f in parse(spec) if f.rank == rank])


def test_a_slow_rank_sleeps_its_seconds_at_every_step_from_its_step_on(monkeypatch):
    slept = []
    monkeypatch.setattr(faults.time, "sleep", lambda s: slept.append(s))
    inj = _injector("slow:rank=1,step=2,seconds=0.25;slow:rank=0,step=0,seconds=9")
    per_step = []
    for step in range(6):
        before = len(slept)
        inj.on_step(step)
        per_step.append(slept[before:])
    assert per_step == [[], [], [0.25], [0.25], [0.25], [0.25]]


@pytest.mark.parametrize("kind", ["kill", "lose"])
def test_kill_and_lose_send_sigkill_to_this_process_at_their_step_only(monkeypatch, kind):
    killed = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    inj = _injector(f"{kind}:rank=1,step=3")
    for step in range(6):
        inj.on_step(step)
        assert killed == ([(os.getpid(), faults.signal.SIGKILL)] if step >= 3 else []), step


def test_raise_raises_at_its_step_only():
    inj = _injector("raise:rank=1,step=2")
    inj.on_step(0)
    inj.on_step(1)
    with pytest.raises(InjectedFault, match="rank 1.*step 2"):
        inj.on_step(2)
    inj.on_step(3)


def test_diskfull_fails_only_the_writes_of_its_step(tmp_path):
    inj = _injector("diskfull:rank=1,step=4")
    inj.before_write(tmp_path / "step-00000003" / "rank-00001.bin", 10)
    with pytest.raises(OSError) as e:
        inj.before_write(tmp_path / "step-00000004" / "rank-00001.bin", 10)
    assert e.value.errno == errno.ENOSPC
    inj.before_write(tmp_path / "step-00000005" / "rank-00001.bin", 10)


@pytest.mark.parametrize("kind", ["corrupt", "truncate"])
def test_corrupt_and_truncate_damage_the_file_of_their_step_as_described(tmp_path, kind):
    data = bytes(range(64))
    paths = {}
    for step in (1, 2, 3):
        d = tmp_path / f"step-{step:08d}"
        d.mkdir()
        paths[step] = d / "rank-00001.bin"
        paths[step].write_bytes(data)
    inj = _injector(f"{kind}:rank=1,step=2")
    for step in (1, 2, 3):
        inj.after_write(paths[step])
    assert paths[1].read_bytes() == data and paths[3].read_bytes() == data
    got = paths[2].read_bytes()
    if kind == "truncate":
        assert got == data[:32]  # cut to half its size
    else:  # the 8 bytes at the middle inverted, the rest untouched
        assert got == data[:32] + bytes(x ^ 0xFF for x in data[32:40]) + data[40:]


def test_faults_for_another_rank_or_attempt_are_not_this_ranks(monkeypatch):
    monkeypatch.setenv("MINIDIST_RESTART", "1")
    inj = Injector.from_env(1, "raise:rank=1,step=0;raise:rank=0,step=0,attempt=1;slow:rank=1,step=0,"
                               "seconds=1,attempt=1")
    assert [(f.kind, f.rank, f.attempt) for f in inj.faults] == [("slow", 1, 1)]
