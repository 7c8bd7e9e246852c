"""Chapter 10's live-recovery lesson: a group killed mid-run, the survivors go on (their PIDs or
threads unchanged), the replacement heals from a live peer, ``restarts: 0``, PASS against the twin --
on threads, under ``mpirun -n 4`` (each MPI rank the agent of one worker process) and under the
supervisor. The expected quorum lines follow from the fault spec: ``kill:group=1,step=4`` (the default)
removes group 1 from step 4's second attempt; with 4 groups of 2 rows the effective batch is 6 of 8."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from minidist.lessons import live_recovery

ROOT = Path(__file__).resolve().parents[2]
ENV = {k: v for k, v in os.environ.items() if k != "MINIDIST_TRANSPORT"} | {"PYTHONPATH": str(ROOT),
                                                                           "OPENBLAS_NUM_THREADS": "1"}


def check(out: str, processes: bool) -> None:
    assert "[quorum] step 0: groups [0, 1, 2, 3] of 4 take part (effective batch 8 rows of 8)" in out
    assert "[quorum] step 4, attempt 1: group 1 lost (member" in out
    assert "groups [0, 2, 3] finish the step" in out
    assert re.search(r"^\s+4  \[0, 2, 3\]\s+-\s+2  6 of 8 rows$", out, re.M), out
    assert re.search(r"group 1 heals from group 0", out)
    assert re.search(r"^heal: group 1 \(member \d+\) took [\d.]+ kB .* rejoined the quorum at step \d+$", out,
                     re.M)
    assert "the job was never restarted: restarts: 0" in out
    assert "healed and survivors: yes (bit-identical)" in out
    assert "max abs diff 0 -> PASS (bit-identical)" in out
    slots = dict(re.findall(r"^  slot (\d) \(group \d, position 0\): (.*)$", out, re.M))
    assert len(slots) == 4
    if processes:  # the survivors: one process each, start to end; slot 1: killed, then its replacement
        for s in ("0", "2", "3"):
            assert re.fullmatch(r"pid \d+ \(finished\)", slots[s]), slots[s]
        assert re.fullmatch(r"pid \d+ \(killed by signal 9\) -> pid \d+ \(finished\)", slots["1"]), slots["1"]
    else:
        assert re.fullmatch(r"live-member-\d+ \(killed \(kill:group=1,step=4\)\) -> "
                            r"live-member-\d+ \(finished\)", slots["1"]), slots["1"]


def test_the_lesson_on_threads(capsys, tmp_path):
    assert live_recovery.main(["--ranks", "4", "--plot", str(tmp_path / "p.png"),
                               "--trace", str(tmp_path / "t.json")]) == 0
    check(capsys.readouterr().out, processes=False)
    assert (tmp_path / "p.png").stat().st_size > 1000 and (tmp_path / "t.json").stat().st_size > 1000


def test_the_lesson_with_tensor_parallel_groups_on_threads(capsys):
    assert live_recovery.main(["--ranks", "4", "--tp", "2", "--fault", "kill:group=0,step=3,pos=1"]) == 0
    out = capsys.readouterr().out
    assert "2 replica groups of 2 (inside a group: tp=2)" in out and "restarts: 0" in out
    assert re.search(r"-> PASS \((bit-identical|within 1e-10: tp sums partial products in another order)\)",
                     out), out


@pytest.mark.parametrize("argv,words", [
    (["--ranks", "3", "--tp", "2"], ["3 ranks do not make 2 or more replica groups", "multiple of 2"]),
    (["--ranks", "4", "--tp", "2", "--pp", "2"], ["--tp or --pp inside a group, not both"]),
    (["--ranks", "2", "--tp", "2"], ["2 ranks do not make 2 or more replica groups of tp x pp = 2"]),
    (["--ranks", "4", "--fault", "bogus:group=1"], ["unknown kind 'bogus'", "kill, hang, unreachable"]),
    (["--ranks", "4", "--fault", "kill:group=x"], ["bad argument 'group=x'"]),
])
def test_bad_flags_are_refused_before_anything_starts(capsys, argv, words):
    with pytest.raises(SystemExit) as info:
        live_recovery.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, err


def _run(cmd, timeout=240):
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=timeout)


@pytest.mark.mpi
@pytest.mark.slow
def test_the_lesson_under_mpirun_keeps_the_survivors_processes():
    r = _run(["mpirun", "-n", "4", sys.executable, "-m", "minidist.lessons.live_recovery"])
    assert r.returncode == 0, r.stdout + r.stderr
    check(r.stdout, processes=True)
    assert "BAD TERMINATION" not in r.stdout + r.stderr  # the MPI job never saw the kill


@pytest.mark.mpi
@pytest.mark.slow
def test_a_hung_worker_is_caught_and_replaced_under_mpirun():
    r = _run(["mpirun", "-n", "4", sys.executable, "-m", "minidist.lessons.live_recovery", "--ranks", "4",
              "--fault", "hang:group=2,step=3", "--hang-timeout", "2", "--steps", "12"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"group 2 lost \(member \d+ hung: no heartbeat for [\d.]+ s \(last: compute of "
                     r"step 3\)\)", r.stdout), r.stdout
    assert "PASS (bit-identical)" in r.stdout
    assert re.search(r"slot 2 \(group 2, position 0\): pid \d+ \(ended by its agent", r.stdout), r.stdout


@pytest.mark.mpi
@pytest.mark.slow
def test_under_the_supervisor_the_job_is_never_restarted(tmp_path):
    r = _run([sys.executable, "-m", "minidist.launch", "-n", "4", "--", sys.executable, "-m",
              "minidist.lessons.live_recovery", "--pp", "2", "--fault", "kill:group=1,step=4,pos=1"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS (bit-identical)" in r.stdout
    assert re.search(r"restarts: 0; steps recomputed: 0", r.stdout), r.stdout  # the supervisor's summary


@pytest.mark.slow  # a supervised job that fails whole and is restarted
def test_a_whole_job_failure_restarts_from_the_checkpoint_and_equals_the_twin(tmp_path):
    """Both groups die in step 3: the error names checkpoint 2; the supervisor restarts the job, which
    resumes there (its quorum sequence restored with it) and PASSes against the twin of all 10 steps."""
    ckpt = str(tmp_path / "ckpt")
    r = _run([sys.executable, "-m", "minidist.launch", "-n", "2", "--threads", "--ckpt", ckpt, "--",
              sys.executable, "-m", "minidist.lessons.live_recovery", "--ckpt", ckpt, "--ckpt-every", "2",
              "--fault", "kill:group=0,step=3;kill:group=1,step=3"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "the last one left, was lost" in r.stdout
    assert "restart the job from its checkpoint of step 2" in r.stdout
    assert "attempt 1: starting 2 ranks (newest intact checkpoint in" in r.stdout
    assert re.search(r"^\s+2  \[0, 1\]", r.stdout, re.M) and not re.search(r"^\s+1  \[0, 1\]", r.stdout, re.M)
    assert "max abs diff 0 -> PASS (bit-identical)" in r.stdout
    assert "restarts: 1" in r.stdout
