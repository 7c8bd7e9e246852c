"""Every job has an id, and a checkpoint folder belongs to one job: real second jobs on a folder in
use, a real SIGKILL of the supervisor (no rank survives it; the next job frees the shared memory the
killed one left), and the supervisor naming the rank whose process really ended first."""

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from minidist.resilience.checkpoint.tiers import shm_root
from minidist.resilience.heartbeat import ORPHAN_S

ROOT = Path(__file__).resolve().parents[2]
ENV = {k: v for k, v in os.environ.items()
       if k not in ("MINIDIST_TRANSPORT", "MINIDIST_JOB_ID", "MINIDIST_HEARTBEAT_DIR")} | {
    "PYTHONPATH": str(ROOT), "OPENBLAS_NUM_THREADS": "1"}


def lesson(ckpt, *args, supervisor=(), steps=30, slow=0.1):
    """The lesson under the supervisor (threads), its steps slowed to ``slow`` s so it runs a while."""
    return [sys.executable, "-m", "minidist.launch", "-n", "2", "--threads", "--max-restarts", "1",
            *supervisor, "--", sys.executable, "-m", "minidist.lessons.fault_tolerance",
            "--steps", str(steps), "--ckpt", str(ckpt), "--mem-every", "1", "--disk-every", "2", "--sync",
            "--fault", f"slow:rank=0,step=0,seconds={slow}", *args]


def wait_for(cond, what, timeout=90.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def job_of(folder) -> str:
    return json.loads((Path(folder) / ".minidist-checkpoints").read_text())["job"]


def test_a_second_job_on_a_folder_in_use_is_refused_and_the_first_finishes_untouched(tmp_path):
    """Job A trains into D. Half a second after A's first checkpoint, job B -- the same command, so a
    new job id -- is started on D twice: with the supervisor told about D (refused before a rank
    starts) and without (the ranks' own check refuses; the supervisor does not restart it). Each names
    both jobs and `--job A`. A finishes bit-identical to a run that never failed, and every checkpoint
    in D is A's."""
    d = tmp_path / "D"
    a = subprocess.Popen(lesson(d, "--mem-dir", str(tmp_path / "memA"), "--out", str(tmp_path / "a.npz"),
                                steps=40, slow=0.15),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, cwd=tmp_path)
    try:
        wait_for(lambda: (d / "latest").exists(), "job A's first checkpoint")
        time.sleep(0.5)
        first = job_of(d)
        for supervisor in (["--ckpt", str(d)], []):
            b = subprocess.run(lesson(d, "--mem-dir", str(tmp_path / "memB"), supervisor=supervisor),
                               capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=120)
            out = b.stdout + b.stderr
            second = re.search(r"job (\S+) \(resume it with --job", b.stdout).group(1)
            assert b.returncode == 1 and second != first, out
            both = (f"checkpoint folder {d} belongs to job '{first}' (its .minidist-checkpoints); this is "
                    f"job '{second}': resume that job with `--job {first}`, or pick another folder")
            assert both in out, out
            assert "restarts: 0;" in b.stdout and not (tmp_path / "memB").exists(), out
        assert a.poll() is None, "job A ended before job B was tried: slow it down"
        out, _ = a.communicate(timeout=180)
    finally:
        if a.poll() is None:
            a.kill()
    assert a.returncode == 0 and "PASS (bit-identical)" in out, out
    for step in (p for p in d.iterdir() if p.name.startswith("step-")):
        assert json.loads((step / "manifest.json").read_text())["job"] == first


def children(pid) -> list[int]:
    kids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            kids += [int(x) for x in f.read().split()]
    return kids


def alive(pid) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except FileNotFoundError:
        return False


def test_a_sigkilled_supervisor_leaves_no_rank_and_the_next_job_frees_its_shared_memory(tmp_path):
    """SIGKILL to the supervisor (it cannot clean up): the job's process notices within ORPHAN_S and
    stops. Its shared-memory tier stays behind, until the next job -- any job -- starts and frees it
    (its lock is free: no live process holds it); its disk tier stays, and `--job ID` resumes it."""
    d = tmp_path / "A"
    mem = Path(shm_root(hashlib.sha1(os.path.abspath(d).encode()).hexdigest()[:10]))
    sup = subprocess.Popen(lesson(d, steps=40), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=ENV, cwd=tmp_path)
    try:
        wait_for(lambda: (d / "latest").exists() and (mem / "latest").exists(), "job A's checkpoints")
        job = children(sup.pid)
        assert len(job) == 1 and alive(job[0])
        sup.kill()  # SIGKILL
        sup.wait()
        t0 = time.time()
        wait_for(lambda: not alive(job[0]), "the job to notice its supervisor died", timeout=30)
        stopped = time.time() - t0
    finally:
        if sup.poll() is None:
            sup.kill()
    assert stopped < ORPHAN_S + 4.0, f"the job ran {stopped:.1f} s after its supervisor died"
    assert mem.exists() and (d / "latest").exists()  # the killed job's tiers: nobody freed them yet
    first = job_of(d)
    other = subprocess.run(lesson(tmp_path / "B", steps=2, slow=0), capture_output=True, text=True, env=ENV,
                           cwd=tmp_path, timeout=120)
    assert other.returncode == 0, other.stdout + other.stderr
    assert not mem.exists() and not Path(str(mem) + "-peer").exists()  # freed by the next job
    assert (d / "latest").exists()  # the disk tier is the killed job's to resume
    resumed = subprocess.run(lesson(d, "--out", str(tmp_path / "a.npz"), steps=40, slow=0,
                                    supervisor=["--job", first]), capture_output=True, text=True, env=ENV,
                             cwd=tmp_path, timeout=180)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert re.search(r"restored from tier disk, step \d+", resumed.stdout), resumed.stdout
    assert "PASS (bit-identical)" in resumed.stdout and not mem.exists()
    assert np.load(tmp_path / "a.npz").files


# A job of 3 rank processes, started and ended as mpirun does: each rank starts (the heartbeat's
# `started`), beats step 1 -- rank 0 first, rank 2 last -- and works on step 2 forever; once one rank
# process ends, the job SIGKILLs the others and exits 1.
RANKS_JOB = """
import os, subprocess, sys, time
if sys.argv[1] == "rank":
    from minidist.resilience.heartbeat import heartbeat, started
    r, out = int(sys.argv[2]), sys.argv[3]
    started(r)
    time.sleep(0.3 * r)
    heartbeat(r, 1)
    open(os.path.join(out, f"pid-{r}-{os.getpid()}"), "w").close()
    time.sleep(3600)  # the middle of step 2
procs = [subprocess.Popen([sys.executable, __file__, "rank", str(r), sys.argv[1]]) for r in range(3)]
while all(p.poll() is None for p in procs):
    time.sleep(0.01)
for p in procs:
    p.kill()
sys.exit(1)
"""


@pytest.mark.parametrize("victim", [1, 2])
def test_the_supervisor_names_the_rank_killed_in_the_middle_of_a_step(tmp_path, victim):
    """Every rank beat step 1, so the beats cannot tell (the one behind is rank 0, the first to beat);
    the rank process that ended first can: the kernel closes its alive file before the job kills the
    others. A real SIGKILL to rank ``victim``'s process."""
    script, out = tmp_path / "job.py", tmp_path / "pids"
    script.write_text(RANKS_JOB)
    out.mkdir()
    sup = subprocess.Popen([sys.executable, "-m", "minidist.launch", "-n", "3", "--threads", "--max-restarts",
                            "0", "--", sys.executable, str(script), str(out)], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env=ENV, cwd=tmp_path)
    try:
        wait_for(lambda: len(os.listdir(out)) == 3, "every rank at step 2")
        pids = {int(n.split("-")[1]): int(n.split("-")[2]) for n in os.listdir(out)}
        os.kill(pids[victim], signal.SIGKILL)
        stdout, _ = sup.communicate(timeout=60)
    finally:
        if sup.poll() is None:
            sup.kill()
    assert "attempt 0 FAILED after" in stdout and f": rank {victim}, its process ended first, exit status 1" \
        in stdout, stdout


# The same under a real mpirun, ranks of minidist.comm.run: each beats step 1 (rank 0 first), then
# waits in step 2's collective; rank RAISER raises instead (the job aborts: MPI_Abort).
MPI_JOB = """
import os, sys, time
from minidist.comm import run
from minidist.resilience.heartbeat import heartbeat

out, raiser = sys.argv[1], int(sys.argv[2])

def body(comm):
    time.sleep(0.3 * comm.rank)
    heartbeat(comm.rank, 1)
    open(os.path.join(out, f"pid-{comm.rank}-{os.getpid()}"), "w").close()
    comm.barrier()
    if comm.rank == raiser:
        time.sleep(0.5)
        raise ValueError(f"a bug on rank {comm.rank} in step 2")
    while True:
        comm.barrier()

run(body)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("victim,raiser", [(1, -1), (2, -1), (-1, 1)])
def test_under_mpirun_the_supervisor_names_the_killed_or_raising_rank(tmp_path, victim, raiser):
    script, out = tmp_path / "job.py", tmp_path / "pids"
    script.write_text(MPI_JOB)
    out.mkdir()
    sup = subprocess.Popen([sys.executable, "-m", "minidist.launch", "-n", "3", "--max-restarts", "0", "--",
                            sys.executable, str(script), str(out), str(raiser)], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env=ENV, cwd=tmp_path)
    try:
        wait_for(lambda: len(os.listdir(out)) == 3, "every rank at step 2")
        if victim >= 0:
            pids = {int(n.split("-")[1]): int(n.split("-")[2]) for n in os.listdir(out)}
            time.sleep(0.3)  # in the middle of step 2: every rank waits in its collective
            os.kill(pids[victim], signal.SIGKILL)
        stdout, _ = sup.communicate(timeout=120)
    finally:
        if sup.poll() is None:
            sup.kill()
    why = (f"rank {victim}, its process ended first" if victim >= 0 else
           f"rank {raiser}, raised ValueError: a bug on rank {raiser} in step 2")
    assert "attempt 0 FAILED after" in stdout and why in stdout, stdout
