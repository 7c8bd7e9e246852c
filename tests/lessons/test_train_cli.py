"""Lesson 1's flags (minidist.lessons.train_cli): each bad value exits with status 2 and one line
naming the flag, before the lesson prints or trains anything."""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist.lessons import train as lesson
from tests.conftest import budget


def refused(argv, capsys) -> str:
    """``main(argv)`` exits with status 2 before printing anything; returns its one error line."""
    with pytest.raises(SystemExit) as info:
        lesson.main(argv)
    out, err = capsys.readouterr()
    assert info.value.code == 2 and out == "", (argv, info.value.code, out)
    return [line for line in err.splitlines() if line.strip()][-1]


@pytest.mark.parametrize("argv,words", [
    (["--steps", "0"], ["--steps", ">= 1", "--load"]),
    (["--steps", "-3"], ["--steps", ">= 1"]),
    (["--load", "NOWHERE"], ["--load", "no such folder"]),
    (["--load", "EMPTY"], ["--load", "no intact checkpoint"]),
    (["--save", "FILE"], ["--save", "is a file"]),
    (["--save", "FOREIGN"], ["--save", "did not write", "notes.txt"]),
    (["--save", "DEEP"], ["--save", "does not exist"]),
    (["--plot", "DEEP"], ["--plot", "does not exist"]),
    (["--task", "sort", "--prompt", "hi"], ["--prompt", "--task sort"]),
    (["--prompt", ""], ["--prompt", "at least one character"]),
    (["--backend", "tensorflow"], ["--backend", "invalid choice"]),
    (["--batch", "100000"], ["--batch", "training windows", "--batch <="]),
])
def test_bad_flags_exit_2_with_one_line_before_any_work(tmp_path, capsys, argv, words):
    (tmp_path / "empty").mkdir()
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("x")
    where = {"NOWHERE": tmp_path / "nowhere", "EMPTY": tmp_path / "empty", "FILE": tmp_path / "file",
             "FOREIGN": tmp_path / "foreign", "DEEP": tmp_path / "no" / "such" / "loss.png"}
    line = refused([str(where.get(a, a)) for a in argv], capsys)
    assert "error:" in line
    for w in words:
        assert w in line, f"{w!r} not in {line!r}"


def test_a_backend_that_is_not_installed_is_a_usage_error(capsys):
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed here")
    except ImportError:
        pass
    line = refused(["--backend", "cupy"], capsys)
    assert "--backend" in line and "CuPy" in line and "pip install" in line


# -- --save is checked with the save's own rule, before training: a trained run is never lost ----------

TINY = ["--layers", "1", "--d-model", "16", "--heads", "2", "--block", "8", "--batch", "2", "--task", "sort"]
ROOT = Path(__file__).resolve().parents[2]


def test_a_save_folder_holding_latest_notes_is_refused_before_training(tmp_path, capsys):
    """The issue's case: the old check let any name starting with ``latest`` pass, the save refused it
    after training, and the run was lost."""
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "latest-notes.txt").write_text("mine")
    line = refused(["--save", str(d), "--steps", "2", *TINY], capsys)
    assert "--save" in line and "did not write (latest-notes.txt)" in line, line
    assert os.listdir(d) == ["latest-notes.txt"]


ENTRIES = ["latest-notes.txt", "latest", "latest.tmp", "step-1", "step-00000001", "step-00000002.tmp",
           "notes", ".minidist-checkpoints.tmp", "marker", "their marker", "link", "world-writable"]


def _tiny_state():
    from minidist.nn import GPT, GPTConfig, optim
    from minidist.resilience.checkpoint import TrainState

    model = GPT(GPTConfig(vocab_size=8, block_size=4, n_layer=1, n_head=1, d_model=4, seed=0))
    return TrainState(model, optim.AdamW(model.parameters()))


@given(st.sets(st.sampled_from(ENTRIES), max_size=4))
@budget(40)
def test_check_save_accepts_a_folder_exactly_when_the_save_can_write_it(entries):
    """Folders drawn from names that look like minidist's and names that do not, a marker of this job
    (unnamed) or of another, a symbolic link, a mode others can write: ``--save``'s check before
    training says yes exactly when the save at the end succeeds."""
    from minidist.comm import world
    from minidist.lessons.train_cli import check_save
    from minidist.resilience import checkpoint

    root = Path(tempfile.mkdtemp()) / "ckpt"
    root.mkdir()
    try:
        for e in sorted(entries, key=lambda e: e != "link"):  # the link (named latest.tmp) first
            if e in ("marker", "their marker"):
                job = None if e == "marker" else "someone-else"
                (root / ".minidist-checkpoints").write_text(json.dumps({"by": "minidist", "job": job}))
            elif e == "link":
                os.symlink("/etc/hostname", root / "latest.tmp")
            elif e == "world-writable":
                os.chmod(root, 0o777)
            elif e.startswith("step-"):
                (root / e).mkdir()
            elif not os.path.lexists(root / e):
                (root / e).write_text("x")
        try:
            check_save(str(root))
            accepted = True
        except ValueError:
            accepted = False
        try:
            checkpoint.save(world(), str(root), 1, _tiny_state())
            saved = True
        except checkpoint.CheckpointError:
            saved = False
        assert accepted == saved, (sorted(entries), accepted, saved)
    finally:
        shutil.rmtree(root.parent, ignore_errors=True)


def _in_private_mounts(script: str, tmp_path) -> subprocess.CompletedProcess:
    """``script`` (sh) in a private mount namespace (``unshare -m``: its mounts vanish with it)."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare -m (the tests run as root)")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS="1", M=str(tmp_path / "m"),
               PY=sys.executable, TMPDIR=str(tmp_path))
    (tmp_path / "m").mkdir()
    return subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=180)


def test_a_full_or_read_only_save_folder_is_refused_before_training(tmp_path):
    """A real 1 MB tmpfs (the checkpoint of the default model needs ~5.8 MB), then the same mounted
    read-only: both refused with exit 2 and one line, before a step is trained."""
    res = _in_private_mounts("""
        mount -t tmpfs -o size=1m,mode=0755 tmpfs "$M" || exit 99
        $PY -m minidist.lessons.train --steps 2 --save "$M/ck"; echo "full: $?"
        mount -o remount,ro "$M"
        $PY -m minidist.lessons.train --steps 2 --save "$M/ck"; echo "read-only: $?"
    """, tmp_path)
    out = res.stdout + res.stderr
    assert "full: 2" in res.stdout and "read-only: 2" in res.stdout, out
    assert re.search(r"argument --save: '.*/ck' has no room for the checkpoint: it needs [0-9,]+ bytes, "
                     r"1,048,576 are free", res.stderr), out
    assert "argument --save: read-only at" in res.stderr and "trained steps" not in res.stdout, out


def test_a_disk_that_fills_during_training_does_not_lose_the_run(tmp_path):
    """A real tmpfs with room at the start, filled while the lesson trains: the save fails, the
    trained state goes to a new folder instead (exit 1, naming it), and it loads: the run is whole."""
    res = _in_private_mounts(f"""
        mount -t tmpfs -o size=1m,mode=0755 tmpfs "$M" || exit 99
        $PY -m minidist.lessons.train --steps 300 {' '.join(TINY)} --save "$M/ck" > log 2>&1 &
        while ! grep -q "^GPT:" log; do sleep 0.05; done
        dd if=/dev/zero of="$M/fill" bs=64k count=100 2>/dev/null
        grep -q "trained steps" log && echo "too late: training finished before the disk filled"
        wait $!; echo "exit: $?"; cat log
    """, tmp_path)
    out = res.stdout + res.stderr
    assert "exit: 1" in res.stdout and "too late" not in res.stdout, out
    m = re.search(r"the trained state \(step 300\) is saved in (\S+) instead: continue with --load (\S+)",
                  out)
    assert m and "disk full at" in out and m.group(1) == m.group(2), out
    again = subprocess.run([sys.executable, "-m", "minidist.lessons.train", "--load", m.group(1), "--steps",
                            "0"], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                           timeout=120)
    assert again.returncode == 0 and "loaded step 300" in again.stdout, again.stdout + again.stderr
