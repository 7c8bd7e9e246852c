"""The supervisor (``python -m minidist.launch``) under real ``mpirun`` (and threads): for each
injected fault the supervised job restarts from its last good checkpoint and ends with parameters
bit-identical to a run that never failed -- computed here, independently, on the threads transport."""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from minidist.comm import run
from minidist.lessons.fault_tolerance_job import MeshTrainer, small_config
from minidist.resilience.faults import parse

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8


def supervise(tmp_path, n, fault, *launch_args, threads=False, job_args=(), timeout=60):
    """Run the fault-tolerance lesson under the supervisor; (completed process, final parameters)."""
    out, ckpt = tmp_path / "final.npz", tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "minidist.launch", "-n", str(n), "--ckpt", str(ckpt), "--log",
           str(tmp_path / "events.jsonl"), *launch_args, *(["--threads"] if threads else []), "--",
           sys.executable, "-m", "minidist.lessons.fault_tolerance", "--steps", str(STEPS),
           "--ckpt", str(ckpt), "--mem-dir", str(tmp_path / "mem"), "--out", str(out), "--fault", fault,
           *job_args]
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("MINIDIST_TRANSPORT", None)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)
    final = dict(np.load(out)) if out.exists() else None
    return res, final


def never_failed(n, dropout=0.1):
    """The uninterrupted run, on the threads transport, with the lesson's model and data."""
    def body(comm):
        t = MeshTrainer(comm, small_config("float64", dropout), total_steps=STEPS)
        while t.step_count < STEPS:
            t.step()
        return t.full_parameters()
    return run(body, ranks=n)[0]


def assert_bit_identical(final, want, res):
    assert final is not None, res.stdout + res.stderr
    assert final.keys() == want.keys() and all(np.array_equal(final[k], want[k]) for k in want), res.stdout


mpi = pytest.mark.mpi  # conftest skips these without mpirun


@pytest.mark.parametrize("fault,recovered", [
    # SIGKILL, under mpirun
    # (asynchronous saves: the one started after step 4 may not be committed when the kill comes)
    pytest.param("kill:rank=1,step=5", "recovered from tier memory checkpoint of step [24]", marks=mpi),
    # an exception, with a straggler (slow, not failed: its heartbeat keeps coming)
    ("raise:rank=0,step=3;slow:rank=1,step=0,seconds=0.02",
     "recovered from tier memory checkpoint of step 2|restarted from scratch"),
    # a file cut (step 4) and bytes flipped (step 6) after hashing: the restart skips both, resumes at 2
    ("truncate:rank=0,step=4;corrupt:rank=0,step=6;kill:rank=1,step=7",
     "recovered from tier disk checkpoint of step 2"),
    # the write of step 6 fails with ENOSPC on rank 1: it is never committed
    ("diskfull:rank=1,step=6;kill:rank=0,step=7", "recovered from tier disk checkpoint of step 4"),
])
def test_supervised_job_recovers_bit_identically(tmp_path, fault, recovered):
    """A kill runs under mpirun; the others, to keep the suite fast, as threads of one process."""
    tiers = ["--mem-every", "0", "--disk-every", "2", "--sync"] if "step=6" in fault else ["--mem-every", "2"]
    res, final = supervise(tmp_path, 2, fault, job_args=tiers, threads=not fault.startswith("kill"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "restarts: 1;" in res.stdout and re.search(recovered, res.stdout), res.stdout
    if parse(fault)[0].kind == "truncate":
        for step, why in ((6, "sha256 differs from the manifest's (corrupted)"),
                          (4, "bytes, the manifest says")):
            assert f"skipped {tmp_path}/ckpt/step-0000000{step}" in res.stdout, res.stdout
            assert why in res.stdout, res.stdout
    assert_bit_identical(final, never_failed(2), res)


@mpi
def test_a_hung_rank_is_detected_by_its_heartbeat(tmp_path):
    res, final = supervise(tmp_path, 2, "hang:rank=1,step=5", "--heartbeat-timeout", "1.5")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "no heartbeat for more than 1.5 s" in res.stdout, res.stdout
    assert "hung; killing the job" in res.stdout, res.stdout
    assert "failure: attempt 0, rank 1: hung at step 5" in res.stdout, res.stdout
    assert_bit_identical(final, never_failed(2), res)


@mpi
def test_elastic_restart_on_fewer_ranks_matches_the_serial_twin(tmp_path):
    res, final = supervise(tmp_path, 4, "lose:rank=3,step=5", "--min-ranks", "2", job_args=["--dropout", "0"])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "lost: elastic restart on 2 ranks" in res.stdout and "elastic restart (4 -> 2 ranks)" in res.stdout
    want = never_failed(1, dropout=0.0)
    for k in want:
        np.testing.assert_allclose(final[k], want[k], rtol=0, atol=1e-10, err_msg=k)


def test_giving_up_after_max_restarts(tmp_path):
    res, final = supervise(tmp_path, 2, "raise:rank=1,step=2,attempt=0;raise:rank=1,step=3,attempt=1",
                           "--max-restarts", "1", threads=True)
    assert res.returncode == 1 and "giving up after 1 restarts" in res.stdout, res.stdout + res.stderr
    assert res.stdout.count("FAILED") == 2 and "rank 1, raise" in res.stdout and final is None


def test_a_job_that_cannot_start_is_not_restarted_forever(tmp_path):
    res, _ = supervise(tmp_path, 3, "none", threads=True)  # a batch of 8 does not split over 3 ranks
    assert res.returncode == 1 and res.stdout.count("FAILED") == 2, res.stdout
    assert "failed twice before its first heartbeat" in res.stdout and "dp=3" in res.stderr


def test_bad_fault_specs_are_clear_errors():
    with pytest.raises(ValueError, match="unknown fault 'explode'"):
        parse("explode:rank=1")
    with pytest.raises(ValueError, match="bad argument 'rank=x'"):
        parse("kill:rank=x")
    assert [(f.kind, f.rank, f.step) for f in parse("kill:rank=1,step=5; hang:step=2")] == [
        ("kill", 1, 5), ("hang", 0, 2)]


SAVING_JOB = """
import sys
from minidist.comm import run
from minidist.resilience.checkpoint import save
from minidist.lessons.fault_tolerance_job import MeshTrainer, small_config
from minidist.resilience.faults import Injector
from minidist.resilience.supervisor import heartbeat

def body(comm):
    t = MeshTrainer(comm, small_config())
    t.step()
    heartbeat(comm.rank, t.step_count)
    save(comm, sys.argv[1], t.step_count, t.state(), fault=Injector.from_env(comm.rank))

run(body, ranks=2)
"""


@pytest.mark.parametrize("fault,why", [("nospace:rank=1,step=1", "disk full at"),
                                       ("readonly:rank=0,step=1", "read-only at")])
def test_a_job_stopped_by_a_full_or_read_only_disk_is_not_restarted_into_the_same_failure(tmp_path, fault,
                                                                                        why):
    script, ckpt = tmp_path / "job.py", tmp_path / "ckpt"
    script.write_text(SAVING_JOB)
    cmd = [sys.executable, "-m", "minidist.launch", "-n", "2", "--threads", "--max-restarts", "3", "--fault",
           fault, "--", sys.executable, str(script), str(ckpt)]  # (--threads appends --ranks 2: unused)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"{why} {ckpt}/step-00000001.tmp" in res.stdout and "not restarting" in res.stdout, res.stdout
    assert "restarts: 0;" in res.stdout and res.stdout.count("FAILED") == 1, res.stdout


@pytest.mark.parametrize("min_ranks,restarted_on", [(2, 2), (3, None), (1, 2)])
def test_an_elastic_restart_is_allowed_down_to_exactly_min_ranks(monkeypatch, min_ranks, restarted_on):
    """4 ranks, 2 lost: 2 left, the largest divisor of 4 that fits is 2. --min-ranks 2 (the boundary)
    and 1 restart on 2 ranks; --min-ranks 3 gives up. The job itself is stubbed (``watch``)."""
    from minidist.resilience.supervisor import Supervisor

    sup = Supervisor(["true"], 4, 1, min_ranks, True, None, 1.0, None)
    seen = []

    def watch(a):
        seen.append(a.ranks)
        if a.number == 0:
            a.lost, a.last_step, a.status = [1, 3], 2, "failed"
            return 1
        a.last_step = 5
        return 0

    monkeypatch.setattr(sup, "watch", watch)
    code = sup.run()
    assert seen == ([4] if restarted_on is None else [4, restarted_on])
    assert code == (1 if restarted_on is None else 0)


def test_an_attempt_got_as_far_as_its_furthest_rank_and_the_one_behind_is_blamed(tmp_path, monkeypatch):
    """A job whose rank 0 beat at step 5 and rank 1 at step 3, then exited 1 (no fault note): the attempt
    reached step 5 (what the next one recomputes from), and rank 1, the one behind, is the failed rank."""
    from minidist.resilience.supervisor import Attempt, Supervisor

    job = ("import sys; from minidist.resilience.supervisor import heartbeat; "
           "heartbeat(0, 5); heartbeat(1, 3); sys.exit(1)")
    sup = Supervisor([sys.executable, "-c", job], 2, 0, None, True, None, 30.0, str(tmp_path / "log"))
    a = Attempt(0, 2, 0.0)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    assert sup.watch(a) == 1
    assert (a.last_step, a.failed_rank, a.status) == (5, 1, "failed (exit status 1)")


NOTES_JOB = """
import os, sys, time
hb = os.environ["MINIDIST_HEARTBEAT_DIR"]
with open(os.path.join(hb, "rank-0"), "w") as f:
    f.write(f"3 {time.time()}\\n")  # rank 0 reached step 3
for name, text in (n.split("=", 1) for n in sys.argv[1].split(";") if n):
    with open(os.path.join(hb, name), "w") as f:
        f.write(text + "\\n")
sys.exit(1)
"""

FULL = "diskfull-pid-7=disk full at /ckpt/step-00000004.tmp"
REFUSED = "refused-pid-7=folder /ckpt belongs to job 'x'"


@pytest.mark.parametrize("notes,restarted", [
    (FULL, False),
    (REFUSED, False),
    (f"{FULL};fault-rank-0=kill kill:rank=0,step=3", True),   # the kill took the job down, not the disk
    (f"{FULL};fault-rank-1=hang hang:rank=1,step=3", True),
    (f"{FULL};fault-rank-0=raise raise:rank=0,step=3", True),
    (f"{REFUSED};fault-rank-1=kill kill:rank=1,step=3", True),
    ("fault-rank-0=kill kill:rank=0,step=3", True),
    ("fault-rank-0=diskfull diskfull:rank=0,step=3", True),    # a fault note, not the job's own: transient
    ("", True),
])
def test_a_full_disk_stops_restarts_only_when_no_fault_note_explains_it(tmp_path, notes, restarted, capsys):
    """The job's notes (``diskfull-*``, ``refused-*``: a save that raised into it) and the fault
    notes (``fault-rank-R``) of one failed attempt, written by a stub job: with a kill, a hang or an
    exception beside the disk-full note the failure is that fault and the job is restarted."""
    from minidist.resilience.supervisor import Supervisor

    sup = Supervisor([sys.executable, "-c", NOTES_JOB, notes], 2, 1, None, True, None, 30.0,
                     str(tmp_path / "log"))
    assert sup.run() == 1
    out = capsys.readouterr().out
    assert len(sup.attempts) == (2 if restarted else 1), out
    assert ("not restarting" in out) == (not restarted), out
    if not restarted:
        assert sup.attempts[0].disk_full == notes.split("=", 1)[1]
        assert f"the job stopped: {sup.attempts[0].disk_full}; a restart would fail the same way" in out


@pytest.mark.parametrize("min_ranks", [None, 1])
def test_every_rank_lost_is_no_elastic_restart_and_no_crash(monkeypatch, min_ranks, capsys):
    from minidist.resilience.supervisor import Supervisor

    sup = Supervisor(["true"], 2, 3, min_ranks, True, None, 1.0, None)

    def watch(a):
        a.lost, a.last_step, a.status = [0, 1], 2, "failed"
        return 1

    monkeypatch.setattr(sup, "watch", watch)
    assert sup.run() == 1 and len(sup.attempts) == 1
    said = f"ranks [0, 1] lost; 0 left, below --min-ranks {min_ranks}: cannot restart"
    assert said in capsys.readouterr().out
