"""The checkpoint folder: a full disk or a read-only folder is a clear error on every rank (never a
hang), the failed step leaves nothing behind and the previous checkpoint stays loadable; minidist
deletes only what it created; two jobs on one folder do not resume each other's state.

Read-only is injected with the ``readonly`` fault hook (tests run as root, where ``chmod`` does not
stop writes); the file-system check (``statvfs``'s read-only flag) is tested with a stand-in statvfs."""

import os
import re
import shutil
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

from minidist.comm import run
from minidist.lessons.fault_tolerance_job import MeshTrainer, small_config
from minidist.resilience.checkpoint import CheckpointError, load, save
from minidist.resilience.checkpoint import folder as folder_mod
from minidist.resilience.checkpoint.tiers import Checkpointer, Tier
from minidist.resilience.checkpoint.writer import snapshot, write_part
from minidist.resilience.faults import Injector

ROOT = Path(__file__).resolve().parents[3]
CFG = small_config("float64", 0.1, n_layer=1)


def _params(t):
    return t.full_state()


def _equal(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def _save_then_fail(comm, root, fault):
    """Save step 1; the save of step 2 fails by ``fault``: each rank returns its error (or None), the
    state at step 1, and whether a later save (step 3) still works."""
    t = MeshTrainer(comm, CFG, zero=1, batch_size=4)
    t.step()
    save(comm, root, 1, t.state())
    at1 = _params(t)
    t.step()
    try:
        save(comm, root, 2, t.state(), fault=Injector.from_env(comm.rank, fault))
        err = None
    except CheckpointError as e:
        err = str(e)
    left = sorted(os.listdir(root))
    comm.barrier()
    t.step()
    save(comm, root, 3, t.state())
    return err, at1, left


def _load_step(comm, root, step):
    t = MeshTrainer(comm, CFG, zero=1, batch_size=4)
    got = load(comm, root, t.state(), required=True)
    return got.step, _params(t)


@pytest.mark.parametrize("fault,why", [
    ("diskfull:rank=1,step=2", "disk full at .*/step-00000002.tmp/rank-00001.bin: it needs [0-9,]+ bytes"),
    ("nospace:rank=0,step=2", "disk full at .*/step-00000002.tmp/rank-00000.bin: it needs [0-9,]+ bytes"),
    ("readonly:rank=0,step=2", "read-only at .*/step-00000002.tmp"),        # rank 0 cannot make the folder
    ("readonly:rank=1,step=2", "read-only at .*/step-00000002.tmp/rank-00001.bin"),  # rank 1 its file
])
def test_a_save_that_cannot_be_written_raises_on_every_rank_and_leaves_the_previous_one(tmp_path, fault, why):
    import re

    root = str(tmp_path / "ckpt")
    t0 = time.monotonic()
    out = run(_save_then_fail, ranks=2, root=root, fault=fault)
    assert time.monotonic() - t0 < 60  # an error, not a wait for a timeout
    for rank, (err, _, left) in enumerate(out):
        assert err is not None and re.search(why, err), (rank, err)
        assert err.startswith(f"rank {rank}: checkpoint of step 2 not written") and "previous one" in err
        assert left == [".minidist-checkpoints", "latest", "step-00000001"], left  # step-2.tmp removed
    # the previous checkpoint is intact: delete the later step 3 and step 1 loads bit-identically
    import shutil

    shutil.rmtree(os.path.join(root, "step-00000003"))
    step, got = run(_load_step, ranks=2, root=root, step=1)[0]
    assert step == 1 and _equal(got, out[0][1])


def test_the_file_system_read_only_flag_is_checked(tmp_path, monkeypatch):
    real = os.statvfs
    monkeypatch.setattr(os, "statvfs", lambda p: types.SimpleNamespace(
        f_flag=os.ST_RDONLY, f_bavail=real(p).f_bavail, f_frsize=real(p).f_frsize))
    with pytest.raises(folder_mod.CheckpointSpaceError, match=f"read-only at {tmp_path}"):
        folder_mod.check_writable(str(tmp_path))


def test_rank_zero_waits_for_the_others_files_at_most_minidist_timeout(tmp_path, monkeypatch):
    """Rank 1 never writes (it died): rank 0's wait ends at MINIDIST_TIMEOUT with an error, and the
    temporary folder is removed."""
    monkeypatch.setenv("MINIDIST_TIMEOUT", "0.3")

    def body(comm):
        t = MeshTrainer(comm, CFG)
        return snapshot(comm, 1, t.state())
    snap = run(body, ranks=1)[0]
    tmp = tmp_path / "step-00000001.tmp"
    tmp.mkdir()
    got = []

    def rank0():
        try:
            write_part(str(tmp_path), str(tmp), 0, 2, snap)
        except CheckpointError as e:
            got.append(str(e))
    waiter = threading.Thread(target=rank0, daemon=True)
    waiter.start()
    waiter.join(10)  # far beyond 0.3 s: a wait that ignores MINIDIST_TIMEOUT fails here, not hangs
    assert not waiter.is_alive(), "rank 0 still waits for rank 1's file"
    assert got and "ranks [1] did not finish writing within 0.3 s (MINIDIST_TIMEOUT)" in got[0], got
    assert not tmp.exists()


def _tiered(comm, root, fault):
    t = MeshTrainer(comm, CFG, zero=1, batch_size=4)
    ck = Checkpointer(comm, [Tier("disk", root, 1)], fault=Injector.from_env(comm.rank, fault))
    while t.step_count < 3:
        t.step()
        ck.maybe_save(t.step_count, t.state())
    ck.wait()
    return ck.errors, sorted(os.listdir(root))


def test_no_room_for_an_asynchronous_save_is_agreed_before_writing_and_training_goes_on(tmp_path):
    out = run(_tiered, ranks=2, root=str(tmp_path / "d"), fault="nospace:rank=1,step=2")
    for errors, _ in out:  # every rank knows, not only the committer
        assert any("disk step 2" in e and "disk full at" in e and "rank-00001.bin" in e
                   for e in errors), errors
    assert out[0][1] == [".minidist-checkpoints", "latest", "step-00000001", "step-00000003"]


# -- never delete what minidist did not create ------------------------------------------------------

def test_a_folder_with_someone_elses_files_is_refused_and_left_alone(tmp_path):
    d = tmp_path / "mine"
    d.mkdir()
    (d / "notes").write_text("keep me")

    def body(comm):
        t = MeshTrainer(comm, CFG)
        t.step()
        save(comm, str(d), 1, t.state())
    with pytest.raises(CheckpointError, match=f"{d} holds files minidist did not write \\(notes\\)"):
        run(body, ranks=2)
    assert sorted(os.listdir(d)) == ["notes"] and (d / "notes").read_text() == "keep me"
    with pytest.raises(CheckpointError, match="refusing to delete it"):
        folder_mod.remove(str(d))
    assert (d / "notes").exists()


def _lesson(ckpt, cwd, *extra, env=None):
    cmd = [sys.executable, "-m", "minidist.lessons.fault_tolerance", "--ranks", "2", "--steps", "2",
           "--disk-every", "1", "--mem-every", "0", "--fault", "none", "--ckpt", str(ckpt),
           "--mem-dir", str(cwd / "mem"), *extra]
    env = {k: v for k, v in os.environ.items() if k not in ("MINIDIST_HEARTBEAT_DIR", "MINIDIST_JOB_ID")} | \
        {"OPENBLAS_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=cwd)


def _tree(d):
    return sorted(str(p.relative_to(d)) for p in Path(d).rglob("*"))


def test_the_lesson_never_deletes_or_writes_a_ckpt_folder_it_did_not_create(tmp_path):
    """Refused before any rank starts (exit 2, one line), nothing touched: a folder of someone else's
    notes, the working folder, and a folder that only looks like minidist's (``latest`` and
    ``step-00000001/results.csv``, no marker: names alone never make a folder minidist's)."""
    d = tmp_path / "D"
    d.mkdir()
    (d / "notes").write_text("keep me")
    looks = tmp_path / "looks"
    (looks / "step-00000001").mkdir(parents=True)
    (looks / "step-00000001" / "results.csv").write_text("1,2\n")
    (looks / "latest").write_text("step-00000001")
    (tmp_path / "here.txt").write_text("x")
    for ckpt, shown in ((d, "(notes)"), (".", "here.txt"), (looks, "(latest, step-00000001)")):
        before = _tree(tmp_path / "looks"), _tree(d)
        res = _lesson(ckpt, tmp_path)
        assert res.returncode == 2, res.stdout + res.stderr
        assert "holds files minidist did not write" in res.stderr and shown in res.stderr, res.stderr
        assert (_tree(tmp_path / "looks"), _tree(d)) == before and (tmp_path / "here.txt").exists()
    with pytest.raises(CheckpointError, match="refusing to delete it"):
        folder_mod.remove(str(looks))
    assert (looks / "step-00000001" / "results.csv").read_text() == "1,2\n"
    # as the memory tier too: refused when the ranks claim it, before a byte is written
    res = _lesson(tmp_path / "new", tmp_path, "--mem-dir", str(looks), "--mem-every", "1")
    assert res.returncode != 0 and "--mem-dir: checkpoint folder" in res.stdout + res.stderr
    assert _tree(looks) == ["latest", "step-00000001", "step-00000001/results.csv"]


def test_a_folder_belongs_to_one_job_and_the_lesson_resumes_only_with_its_job_id(tmp_path):
    """A new folder is the job's (--job first); a second run -- a new job -- is refused, naming both
    jobs and how to resume; the first job's id resumes it (its last checkpoint: nothing to redo)."""
    new = tmp_path / "new"
    res = _lesson(new, tmp_path, "--job", "first")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "step-00000002" in os.listdir(new)
    res = _lesson(new, tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert (f"checkpoint folder {new} belongs to job 'first' (its .minidist-checkpoints); this is a new job: "
            "resume that job with `--job first`, or pick another folder") in res.stderr
    res = _lesson(new, tmp_path, env={"MINIDIST_JOB_ID": "second"})  # as the supervisor names a job
    assert res.returncode == 2 and "this is job 'second'" in res.stderr, res.stderr
    res = _lesson(new, tmp_path, "--job", "first")
    assert res.returncode == 0 and "restored from tier disk, step 2" in res.stdout, res.stdout + res.stderr


def test_an_empty_ckpt_is_refused_before_the_job_starts(tmp_path):
    """``--ckpt ''`` made every save fail while the job went on and exited 0."""
    res = _lesson("", tmp_path)
    assert res.returncode == 2 and "argument --ckpt: checkpoint folder '': an empty path" in res.stderr, \
        res.stdout + res.stderr
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-m", "minidist.launch", "-n", "2", "--threads", "--ckpt", "", "--",
                          sys.executable, "-c", "pass"], capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 1 and "--ckpt '': give the job's checkpoint folder" in res.stderr, res.stderr


def test_a_tier_whose_every_save_failed_fails_the_lesson(tmp_path):
    """Saves that all fail protect nothing: the run says FAIL (exit 1), naming the first error."""
    res = _lesson(tmp_path / "ro", tmp_path, "--disk-every", "1", "--fault", "readonly:rank=0,step=1;"
                  "readonly:rank=0,step=2", "--sync")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "FAIL: every disk checkpoint of this attempt failed (the first: disk step 1:" in res.stdout, \
        res.stdout


# -- two jobs, one folder ------------------------------------------------------------------------------

def _job(comm, root, job, steps, data_seed, resume=False):
    t = MeshTrainer(comm, CFG, data_seed=data_seed, job=job)
    info = load(comm, root, t.state()) if resume else None
    errors = []
    while t.step_count < steps:
        t.step()
        try:
            save(comm, root, t.step_count, t.state())
        except CheckpointError as e:
            errors.append(str(e))
    return (info.step, info.problems) if info else None, errors, t.full_parameters()


def test_two_jobs_on_one_folder_never_resume_each_others_state(tmp_path):
    root = str(tmp_path / "shared")
    _, errors, a_final = run(_job, ranks=2, root=root, job="a", steps=2, data_seed=0)[0]
    assert errors == []
    both = (f"checkpoint folder {root} belongs to job 'a' (its .minidist-checkpoints); this is job 'b': "
            "resume that job with `--job a`, or pick another folder")
    with pytest.raises(CheckpointError, match=re.escape(both)):  # b's load: an error, not a fresh start
        run(_job, ranks=2, root=root, job="b", steps=2, data_seed=1, resume=True)
    _, errors, _ = run(_job, ranks=2, root=root, job="b", steps=2, data_seed=1)[0]  # b's saves
    assert len(errors) == 2 and all(both in e for e in errors), errors
    (step, problems), _, a_again = run(_job, ranks=2, root=root, job="a", steps=2, data_seed=0,
                                       resume=True)[0]
    assert step == 2 and problems == [] and _equal(a_again, a_final)  # a's checkpoints are untouched


def test_of_jobs_claiming_one_empty_folder_at_once_exactly_one_wins(tmp_path):
    """Eight claims at the same instant (threads released by one barrier): one job owns the folder,
    the seven others are refused naming it -- the marker is linked into place, never replaced."""
    root, n = str(tmp_path / "race"), 8
    for trial in range(20):
        shutil.rmtree(root, ignore_errors=True)
        gate, won, lost = threading.Barrier(n), [], []

        def claim(job, gate=gate, won=won, lost=lost):
            gate.wait()
            try:
                folder_mod.claim(root, job)
                won.append(job)
            except CheckpointError as err:
                lost.append(str(err))
        threads = [threading.Thread(target=claim, args=(f"job{i}",)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        owner = folder_mod.owner(root)["job"]
        assert won == [owner] and len(lost) == n - 1, (trial, won, lost)
        assert all(f"belongs to job {owner!r}" in e for e in lost), lost
        assert sorted(os.listdir(root)) == [".minidist-checkpoints"]


# -- links and other users ----------------------------------------------------------------------------

def _save_step(comm, root, step):
    t = MeshTrainer(comm, CFG)
    t.step()
    try:
        save(comm, root, step, t.state())
    except CheckpointError as e:
        return str(e)


@pytest.mark.parametrize("link,target", [
    ("latest.tmp", "file"),                   # commit: latest's temporary file
    (".minidist-checkpoints.tmp", "file"),    # in an unmarked folder
    (".minidist-checkpoints", "file"),        # the marker itself
    ("step-00000002.tmp", "folder"),          # the step's temporary folder
    ("step-00000002", "folder"),              # a finished step's name
])
def test_a_save_never_writes_through_a_symbolic_link(tmp_path, link, target):
    """A real symlink planted in the checkpoint folder, pointing outside it: the save is refused with
    an error naming the link (or goes around it), and the file or folder it points to is untouched."""
    victim = tmp_path / "victim"
    if target == "file":
        victim.write_text("precious")
    else:
        victim.mkdir()
        (victim / "precious").write_text("precious")
    root = tmp_path / "ckpt"
    marked = not link.startswith(".minidist-checkpoints")
    if marked:
        assert run(_save_step, ranks=2, root=str(root), step=1) == [None, None]
    else:
        root.mkdir()
    os.symlink(victim, root / link)
    errs = run(_save_step, ranks=2, root=str(root), step=2)
    if target == "file":
        assert victim.read_text() == "precious"
    else:
        assert sorted(os.listdir(victim)) == ["precious"]
    assert os.path.islink(root / link)
    for rank, err in enumerate(errs):
        why = f"holds symbolic links ({link})"
        assert err is not None and err.startswith(f"rank {rank}: ") and why in err and link in err, err
    if marked:  # the previous checkpoint stays the latest, whole
        assert (root / "latest").read_text() == "step-00000001"


@pytest.mark.parametrize("link", ["latest.tmp", "step-00000001.tmp/rank-00000.bin",
                                  "step-00000001.tmp/manifest.json.tmp",
                                  "step-00000001.tmp/rank-00000.json.tmp"])
def test_a_link_planted_while_a_save_is_written_is_never_written_through(tmp_path, link):
    """After the folder was checked (``prepare``), a link appears where the save writes next: every
    write opens with O_NOFOLLOW, so the save fails naming the link and the victim is untouched."""
    from minidist.resilience.checkpoint.writer import prepare

    victim, root = tmp_path / "victim", tmp_path / "ckpt"
    victim.write_text("precious")

    def body(comm):
        snap = snapshot(comm, 1, MeshTrainer(comm, CFG).state())
        tmp = prepare(comm, str(root), 1)
        os.symlink(victim, root / link)
        try:
            write_part(str(root), tmp, 0, 1, snap)
        except CheckpointError as e:
            return str(e)
    err = run(body, ranks=1)[0]
    assert err is not None and "is a symbolic link; minidist never writes through one" in err, err
    assert victim.read_text() == "precious" and not (root / "latest").exists()


def test_a_checkpoint_folder_that_is_a_link_or_that_others_can_write_is_refused(tmp_path):
    """0777 (the issue), group-writable, another user's, a symbolic link: each refused before a byte is
    written, the message saying why; 0755 of this user is fine."""
    cases = {"world": (0o777, None), "group": (0o775, None), "other user": (0o755, 65534)}
    for name, (mode, uid) in cases.items():
        d = tmp_path / name
        d.mkdir()
        os.chmod(d, mode)
        if uid is not None:
            os.chown(d, uid, -1)
        why = f"owned by uid {uid}" if uid is not None else f"writable by other users (mode {mode:o})"
        assert why in run(_save_step, ranks=2, root=str(d), step=1)[0]
        assert os.listdir(d) == [], name
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "link")
    assert "is a symbolic link (to" in run(_save_step, ranks=2, root=str(tmp_path / "link"), step=1)[0]
    assert os.listdir(real) == []
    os.chmod(tmp_path / "world", 0o755)
    assert run(_save_step, ranks=2, root=str(tmp_path / "world"), step=1) == [None, None]


def test_candidates_are_newest_first_and_the_supervisor_reports_the_newest_intact_one(tmp_path):
    """Three finished steps 2, 10, 7 (not in name order on purpose): candidates list 10, 7, 2. The
    supervisor's report is the newest that verifies: 10 while it is intact, 7 once 10 is damaged."""
    from minidist.lessons.fault_tolerance_job import MeshTrainer, small_config
    from minidist.resilience.checkpoint import save
    from minidist.resilience.checkpoint.files import candidates
    from minidist.resilience.supervisor import newest_good_checkpoint

    root = tmp_path / "ckpt"

    def body(comm):
        t = MeshTrainer(comm, small_config())
        for step in (2, 10, 7):
            save(comm, str(root), step, t.state(), keep=5)
    run(body, ranks=1)
    dirs, problems = candidates(str(root))
    assert [os.path.basename(d) for d in dirs] == ["step-00000010", "step-00000007", "step-00000002"]
    assert newest_good_checkpoint(str(root))[0] == 10
    with open(root / "step-00000010" / "rank-00000.bin", "r+b") as f:
        f.write(b"\xff\xff\xff\xff")
    step, problems = newest_good_checkpoint(str(root))
    assert step == 7 and any("step-00000010" in p for p in problems)


def test_prune_removes_leftover_temporary_folders_up_to_and_including_the_newest_step(tmp_path):
    """Finished steps 3 and 5; leftovers step-3.tmp, step-5.tmp (a crashed re-save of the newest step)
    and step-7.tmp (a later save perhaps still being written). prune keeps the last 2 steps, removes the
    .tmp folders of steps <= 5 and leaves step 7's."""
    from minidist.resilience.checkpoint.files import prune

    for name in ("step-00000003", "step-00000005", "step-00000003.tmp", "step-00000005.tmp",
                 "step-00000007.tmp"):
        os.makedirs(tmp_path / name)
    prune(str(tmp_path), keep=2)
    assert sorted(os.listdir(tmp_path)) == ["step-00000003", "step-00000005", "step-00000007.tmp"]
    prune(str(tmp_path), keep=1)
    assert sorted(os.listdir(tmp_path)) == ["step-00000005", "step-00000007.tmp"]


def test_sweep_frees_only_held_folders_of_dead_jobs(tmp_path):
    """``sweep`` (the killed jobs' /dev/shm tiers): a held folder whose job is dead goes; one a live
    process holds (a real second process, its lock on the marker), this job's own, one marked without
    ``hold`` (a library save) and one without a marker stay."""
    for name, job, hold in (("p-dead", "dead", True), ("p-live", "live", True), ("p-mine", "me", True),
                            ("p-library", "lib", False)):
        folder_mod.claim(str(tmp_path / name), job)
        if hold:  # as claim(hold=True) marks it, without this process holding the lock
            m = tmp_path / name / ".minidist-checkpoints"
            m.write_text(m.read_text().replace('"held": false', '"held": true'))
    (tmp_path / "p-plain").mkdir()
    (tmp_path / "q-dead").mkdir()  # another prefix
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time; "
                               "fd = os.open(sys.argv[1], os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_SH); "
                               "print('held', flush=True); time.sleep(60)",
                               str(tmp_path / "p-live" / ".minidist-checkpoints")], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        gone = folder_mod.sweep(str(tmp_path), "p-", "me")
        assert gone == [str(tmp_path / "p-dead")]
        assert sorted(os.listdir(tmp_path)) == ["p-library", "p-live", "p-mine", "p-plain", "q-dead"]
    finally:
        holder.kill()
        holder.wait()
    assert folder_mod.sweep(str(tmp_path), "p-", "me") == [str(tmp_path / "p-live")]  # its holder died


def test_sweep_keeps_a_held_folder_between_two_attempts_while_its_supervisor_lives(tmp_path, monkeypatch):
    """Between a killed attempt and the next no rank holds the tier's lock; the marker names the job's
    supervisor (MINIDIST_SUPERVISOR_PID), and another job's sweep leaves the folder while that process
    lives (a concurrent job's sweep emptied a restarting job's memory tier: it resumed from scratch)."""
    supervisor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        monkeypatch.setenv("MINIDIST_SUPERVISOR_PID", str(supervisor.pid))
        folder_mod.claim(str(tmp_path / "p-restarting"), "job-a", hold=True)
        os.close(folder_mod._HELD.pop(str(tmp_path / "p-restarting")))  # as a killed attempt drops it
        assert folder_mod.sweep(str(tmp_path), "p-", "job-b") == []
        assert (tmp_path / "p-restarting" / ".minidist-checkpoints").exists()
    finally:
        supervisor.kill()
        supervisor.wait()
    assert folder_mod.sweep(str(tmp_path), "p-", "job-b") == [str(tmp_path / "p-restarting")]


# -- ownership rows by hand: ``check``, ``check_owner`` and ``remove`` on folders made here --

class _Rank0:
    rank = 0

    def bcast_obj(self, obj, root=0):
        return obj


def _marked(tmp_path, job, name="ckpt"):
    d = tmp_path / name
    folder_mod.claim(str(d), job)
    return str(d)


@pytest.mark.parametrize("job,said", [(None, "this is an unnamed job"), ("B", "this is job 'B'"),
                                      (folder_mod.NEW_JOB, "this is a new job"), ("A", None)])
def test_a_folder_of_job_a_is_refused_to_every_other_job_named_or_not(tmp_path, job, said):
    root = _marked(tmp_path, "A")
    for how in (lambda: folder_mod.check(root, job), lambda: folder_mod.remove(root, job),
                lambda: folder_mod.check_owner(_Rank0(), root, job)):
        if said is None:
            continue
        with pytest.raises(CheckpointError, match=f"{re.escape(root)} belongs to job 'A'.*; {said}: resume"):
            how()
        assert os.listdir(root) == [".minidist-checkpoints"]
    if said is None:
        folder_mod.check(root, job)
        folder_mod.check_owner(_Rank0(), root, job)
        folder_mod.remove(root, job)
        assert not os.path.exists(root)


def test_a_folder_marked_by_an_unnamed_job_is_refused_to_a_named_one_and_taken_by_another_unnamed(tmp_path):
    root = _marked(tmp_path, None)
    with pytest.raises(CheckpointError,
                       match="belongs to an unnamed job .*; this is job 'A': remove the folder"):
        folder_mod.check(root, "A")
    folder_mod.check(root, None)


@pytest.mark.parametrize("names,refused", [
    ([], None),
    ([".minidist-checkpoints.123-456.tmp"], None),                     # a marker a dead job was making
    (["step-00000001/"], "step-00000001"),                            # our names, but not our folder
    (["latest"], "latest"),
    (["step-00000001/", "latest", "step-00000002.tmp/"], "latest, step-00000001, step-00000002.tmp"),
    (["step-00000001/", "notes.txt"], "notes.txt, step-00000001"),
    ([".minidist-checkpoints.tmp"], ".minidist-checkpoints.tmp"),      # not a leftover's name
    ([".minidist-checkpoints"], ".minidist-checkpoints"),              # a marker minidist did not write
    (["a", "b", "c", "d"], "a, b, c, ..."),
])
def test_an_unmarked_folder_must_be_empty_even_of_names_like_ours(tmp_path, names, refused):
    root = tmp_path / "ckpt"
    root.mkdir()
    for n in names:
        (root / n).mkdir() if n.endswith("/") else (root / n).write_text('{"by": "someone"}')
    if refused is None:
        folder_mod.check(str(root), "A")
        return
    said = f"holds files minidist did not write \\({re.escape(refused)}\\)"
    with pytest.raises(CheckpointError, match=said):
        folder_mod.check(str(root), "A")
    with pytest.raises(CheckpointError, match="not a checkpoint folder minidist created"):
        folder_mod.remove(str(root))
    assert sorted(os.listdir(root)) == sorted(n.rstrip("/") for n in names)
