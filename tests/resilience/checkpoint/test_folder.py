"""The checkpoint folder: a full disk or a read-only folder is a clear error on every rank (never a
hang), the failed step leaves nothing behind and the previous checkpoint stays loadable; minidist
deletes only what it created; two jobs on one folder do not resume each other's state.

Read-only is injected with the ``readonly`` fault hook (tests run as root, where ``chmod`` does not
stop writes); the file-system check (``statvfs``'s read-only flag) is tested with a stand-in statvfs."""

import os
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
from minidist.resilience.checkpoint.files import CheckpointWarning
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


def _lesson(ckpt, cwd):
    cmd = [sys.executable, "-m", "minidist.lessons.fault_tolerance", "--ranks", "2", "--steps", "2",
           "--disk-every", "1", "--mem-every", "0", "--fault", "none", "--ckpt", str(ckpt),
           "--mem-dir", str(cwd / "mem")]
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("MINIDIST_HEARTBEAT_DIR", None)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=cwd)


def test_the_lesson_never_deletes_a_ckpt_folder_it_did_not_create(tmp_path):
    d = tmp_path / "D"
    d.mkdir()
    (d / "notes").write_text("keep me")
    res = _lesson(d, tmp_path)
    assert res.returncode != 0 and "refusing to delete it" in res.stdout + res.stderr, res.stdout + res.stderr
    assert sorted(os.listdir(d)) == ["notes"]
    (tmp_path / "here.txt").write_text("x")  # --ckpt . : the working folder
    res = _lesson(".", tmp_path)
    assert res.returncode != 0 and (tmp_path / "here.txt").exists() and (d / "notes").exists()
    res = _lesson(tmp_path / "new", tmp_path)  # a folder it creates: used, and replaced on the next run
    assert res.returncode == 0, res.stdout + res.stderr
    assert "step-00000002" in os.listdir(tmp_path / "new")
    assert _lesson(tmp_path / "new", tmp_path).returncode == 0


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
    with pytest.warns(CheckpointWarning, match="written by job 'a', not this job 'b'"):
        (step, problems), errors, _ = run(_job, ranks=2, root=root, job="b", steps=2, data_seed=1,
                                          resume=True)[0]
    assert step is None  # b starts fresh rather than from a's state
    assert len(errors) == 2 and all(f"{root} belongs to job 'a'" in e for e in errors), errors
    (step, problems), _, a_again = run(_job, ranks=2, root=root, job="a", steps=2, data_seed=0,
                                       resume=True)[0]
    assert step == 2 and problems == [] and _equal(a_again, a_final)  # a's checkpoints are untouched


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
