"""The supervisor owns its job: SIGTERM / SIGINT to ``python -m minidist.launch`` stop every rank
(the job runs in its own session, so only killing its process group reaches them); a hang before a
rank's first step is caught by ``--heartbeat-timeout``; the blamed rank is the one that stopped;
a timeout that is not a positive number of seconds is refused."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from minidist.resilience import supervisor
from minidist.resilience.supervisor import STARTED, blame, stale_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {k: v for k, v in os.environ.items() if k != "MINIDIST_TRANSPORT"} | {"PYTHONPATH": ROOT}

# a job whose ranks record their process ids, then beat forever (or, rank HANG, never get to step 0)
JOB = """
import os, sys, time
from minidist.comm import run
from minidist.resilience.supervisor import heartbeat

out, hang = sys.argv[1], int(sys.argv[2])

def body(comm):
    open(os.path.join(out, f"pid-{comm.rank}-{os.getpid()}"), "w").close()
    if comm.rank == hang:
        time.sleep(3600)  # stuck before its first step (a restore, a collective)
    for step in range(10**6):
        heartbeat(comm.rank, step)
        time.sleep(0.05)

ranks = int(sys.argv[sys.argv.index("--ranks") + 1]) if "--ranks" in sys.argv else None
run(body, ranks=ranks)
"""


def launch(tmp_path, n, *opts, hang=-1, wrap=()):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    out = tmp_path / "pids"
    out.mkdir()
    cmd = [sys.executable, "-m", "minidist.launch", "-n", str(n), *opts, "--", *wrap, sys.executable,
           str(script), str(out), str(hang)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                            cwd=ROOT), out


def rank_pids(out, n, timeout=120.0):
    """The rank processes' ids, once every rank has started."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        names = os.listdir(out)
        if len(names) == n:
            return {int(name.split("-")[2]) for name in names}
        time.sleep(0.1)
    raise AssertionError(f"only {os.listdir(out)} of {n} ranks started")


def alive(pid) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()  # a zombie has ended
    except FileNotFoundError:
        return False


def wait_gone(pids, timeout=20.0) -> set:
    deadline = time.time() + timeout
    while time.time() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return {p for p in pids if alive(p)}


TRANSPORTS = ["threads", pytest.param("mpi", marks=pytest.mark.skipif(
    shutil.which("mpirun") is None and not os.path.exists(os.path.join(os.path.dirname(sys.executable),
                                                                        "mpirun")), reason="no mpirun"))]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_signal_to_the_supervisor_stops_every_rank(tmp_path, transport, sig):
    n = 2
    opts = ["--threads"] if transport == "threads" else []
    proc, out = launch(tmp_path, n, "--heartbeat-timeout", "60", *opts)
    try:
        pids = rank_pids(out, n)
        assert all(alive(p) for p in pids)
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, (proc.returncode, stdout, stderr)
    assert f"{signal.Signals(sig).name}: stopped the job" in stdout, stdout
    assert wait_gone(pids) == set(), f"ranks survived the supervisor: {pids}"


def test_a_hang_before_the_first_step_is_caught_by_the_heartbeat_timeout(tmp_path):
    proc, _ = launch(tmp_path, 3, "--threads", "--heartbeat-timeout", "1.5", "--max-restarts", "0", hang=1)
    try:
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, (stdout, stderr)
    assert "no heartbeat for more than 1.5 s (rank 1:" in stdout, stdout
    assert "rank 1, hung before its first step" in stdout, stdout


def test_stale_ranks_count_a_rank_that_never_beat_from_the_jobs_first_beat():
    assert stale_ranks({}, 4, now=100.0, timeout=1.0) == {}  # not started: nothing to judge
    beats = {0: (7, 99.5), 2: (STARTED, 95.0)}  # rank 1 and 3 never beat; the first beat was at 95
    assert stale_ranks(beats, 4, now=100.0, timeout=1.0) == {1: 5.0, 2: 5.0, 3: 5.0}
    assert stale_ranks(beats, 4, now=95.5, timeout=1.0) == {}


def test_the_blamed_rank_is_the_one_that_stopped():
    # rank 1 stopped after step 4; ranks 0 and 2 got to step 5 and then waited for it (rank 0 is
    # silent longer, but it got further): the lowest step is blamed first
    beats = {0: (5, 10.0), 1: (4, 10.5), 2: (5, 10.2)}
    stale = {0: 3.0, 1: 2.5, 2: 2.8}
    assert blame(beats, stale) == 1
    # a rank that never beat stopped before everyone
    assert blame({0: (3, 1.0)}, {0: 5.0, 1: 5.0}) == 1
    assert blame({0: (3, 1.0), 1: (STARTED, 2.0)}, {0: 5.0, 1: 4.0}) == 1
    # same step: the one silent longest (its peers went on until they waited for it)
    assert blame({0: (5, 1.0), 1: (5, 2.0)}, {0: 4.0, 1: 3.0}) == 0


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_a_heartbeat_timeout_that_is_not_positive_seconds_is_refused(value):
    with pytest.raises(SystemExit) as info:
        supervisor.main(["-n", "2", "--threads", "--heartbeat-timeout", value, "--", "python", "-c", "pass"])
    assert "--heartbeat-timeout must be a finite number of seconds > 0" in str(info.value)
    assert value in str(info.value)


@pytest.mark.parametrize("transport", ["threads", "threads, SIGTERM ignored",
                                       pytest.param("mpi", marks=pytest.mark.mpi)])
def test_a_sigkilled_supervisor_leaves_no_rank_running(tmp_path, transport):
    """SIGKILL cannot be caught, so the supervisor cannot stop its job: the launcher gets SIGTERM
    (PR_SET_PDEATHSIG), and each rank watches the supervisor itself (heartbeat.started) and stops
    within ORPHAN_S -- also when the job ignores SIGTERM (as a launcher might: only the watch helps)."""
    from minidist.resilience.heartbeat import ORPHAN_S

    n = 2
    opts = ["--threads"] if transport.startswith("threads") else []
    wrap = ["sh", "-c", 'trap "" TERM; exec "$0" "$@"'] if "ignored" in transport else []
    proc, out = launch(tmp_path, n, "--heartbeat-timeout", "60", *opts, wrap=wrap)
    try:
        pids = rank_pids(out, n)
        launcher = {int(c) for t in os.listdir(f"/proc/{proc.pid}/task")
                    for c in open(f"/proc/{proc.pid}/task/{t}/children").read().split()}
        proc.kill()
        proc.wait()
        t0 = time.time()
        left = wait_gone(pids | launcher, timeout=ORPHAN_S + 10)
        took = time.time() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert left == set(), f"ranks survived their supervisor's SIGKILL: {left}"
    assert took < ORPHAN_S + 3.0, f"the ranks ran on {took:.1f} s after their supervisor died"


def test_a_job_that_does_not_watch_dies_with_its_sigkilled_supervisor_too(tmp_path):
    """A command that never imports minidist (no watch): PR_SET_PDEATHSIG alone ends it."""
    pidfile = tmp_path / "pid"
    job = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(600)"
    proc = subprocess.Popen([sys.executable, "-m", "minidist.launch", "-n", "1", "--threads", "--",
                             sys.executable, "-c", job, str(pidfile)], stdout=subprocess.PIPE, text=True,
                            env=ENV, cwd=ROOT)
    try:
        deadline = time.time() + 60
        while not (pidfile.exists() and pidfile.read_text()) and time.time() < deadline:
            time.sleep(0.05)
        pid = int(pidfile.read_text())
        proc.kill()
        proc.wait()
        assert wait_gone({pid}, timeout=5.0) == set(), "the job outlived its supervisor"
    finally:
        if proc.poll() is None:
            proc.kill()
