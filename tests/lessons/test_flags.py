"""Every lesson's flags are checked before any rank starts: a bad value exits with status 2 and one
line naming the flag (argparse's ``error``), a good one reaches ``launch``. Each lesson's ``main`` is
run with ``launch`` replaced by a stub that records the call, so no training runs here."""

import importlib
import os
import subprocess
import sys

import pytest

from minidist.lessons import cli
from minidist.lessons import train as train_lesson


class Launched(Exception):
    """Raised by the stub ``launch``: the flags got past every check."""


@pytest.fixture
def lesson(monkeypatch):
    def load(name):
        mod = importlib.import_module(f"minidist.lessons.{name}")

        def stub(rank_main, args):
            raise Launched(args)

        monkeypatch.setattr(mod, "launch", stub)
        return mod
    return load


def refused(main, argv, capsys) -> str:
    """``main(argv)`` exits with status 2 before launching; returns its error line."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2, f"{argv}: exit {info.value.code}"
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert "error:" in lines[-1], lines
    return lines[-1]


# (lesson, argv, words the error line must contain): each a value a rank would refuse or choke on
BAD = [
    ("allreduce", ["--elements", str(10**12)], ["--elements", "GiB", "available", "<="]),
    ("allreduce", ["--ranks", "100000"], ["--ranks", f"at most {cli.MAX_THREAD_RANKS}", "mpirun"]),
    ("allreduce", ["--ranks", "0"], ["--ranks", ">= 1"]),
    ("data_parallel", ["--ranks", "2", "--accum", "5", "--batch", "12"],
     ["--accum", "[4, 5]", "--accum <= 4"]),
    ("data_parallel", ["--ranks", "4", "--batch", "3"], ["--batch", "no rows"]),
    ("fault_tolerance", ["--ranks", "4", "--pp", "3"], ["--pp", "world has 4", "--ranks 3"]),
    ("fault_tolerance", ["--ranks", "4", "--tp", "3"], ["--tp", "world has 4"]),
    ("fault_tolerance", ["--ranks", "4", "--zero", "2", "--tp", "2"],
     ["--zero", "data parallel only", "--tp 1"]),
    ("fault_tolerance", ["--ranks", "3"], ["--ranks", "does not split", "--ranks 2"]),
    ("fault_tolerance", ["--ranks", "4", "--out", "/nonexistent/x.npz"], ["--out", "does not exist"]),
    ("fault_tolerance", ["--ranks", "4", "--fault", "bogus"], ["--fault", "unknown fault", "kill:rank=3"]),
    ("fault_tolerance", ["--ranks", "4", "--fault", "kill:rank=4,step=2"], ["--fault", "ranks 0..3"]),
    ("fault_tolerance", ["--ranks", "2", "--ckpt", ""], ["--ckpt", "checkpoint folder '': an empty path"]),
    ("fault_tolerance", ["--ranks", "2", "--job", "../x"], ["--job", "letters, digits"]),
    ("moe", ["--ranks", "4", "--tokens", "2"], ["--tokens", "--tokens >= 32"]),
    ("moe", ["--ranks", "3", "--experts", "4"], ["--experts", "multiple of the 3 ranks"]),
    ("mixed_precision", ["--dim", "10"], ["--dim", "multiple of the 4"]),
    ("mixed_precision", ["--lr", "nan"], ["--lr", "finite"]),
    ("pipeline", ["--ranks", "8", "--dp", "3"], ["world"]),
    ("planning", ["--ranks", "4", "--batch", "6"], ["--batch", "multiple of the 4"]),
    ("load_balancing", ["--ranks", "4", "--batch", "3"], ["--batch", "at least"]),
    ("offload", ["--steps", "1"], ["--steps", ">= 2"]),
    ("checkpointing", ["--dim", "6"], ["--dim", "multiple of the 4"]),
    ("compression", ["--steps", "0"], ["--steps", ">= 1"]),
]


@pytest.mark.parametrize("name,argv,words", BAD, ids=[f"{b[0]} {' '.join(b[1])}" for b in BAD])
def test_a_bad_flag_is_refused_before_any_rank_starts(lesson, capsys, name, argv, words):
    line = refused(lesson(name).main, argv, capsys)
    for w in words:
        assert w in line, f"{w!r} not in {line!r}"


GOOD = [
    ("allreduce", ["--ranks", "2", "--elements", "64"]),
    ("data_parallel", ["--ranks", "2", "--accum", "4", "--batch", "12"]),
    ("fault_tolerance", ["--ranks", "4", "--pp", "2", "--tp", "2"]),
    ("fault_tolerance", ["--ranks", "2", "--zero", "2", "--fault", "kill:rank=1,step=3"]),
    ("moe", ["--ranks", "4", "--tokens", "32"]),
    ("moe", ["--ranks", "3", "--experts", "3"]),
    ("mixed_precision", ["--ranks", "2"]),
]


@pytest.mark.parametrize("name,argv", GOOD, ids=[f"{g[0]} {' '.join(g[1])}" for g in GOOD])
def test_good_flags_reach_launch(lesson, name, argv):
    with pytest.raises(Launched):
        lesson(name).main(argv)


@pytest.mark.parametrize("argv,words", [
    (["--text", "BINARY"], ["--text", "not UTF-8"]),
    (["--text", "SHORT"], ["--block", "shorter than one window", "--block <= 5"]),
    (["--block", str(10**8)], ["--block", "--block <="]),
    (["--text", "FOLDER"], ["--text", "is a folder"]),
    (["--text", "MISSING"], ["--text", "no such file"]),
    (["--d-model", "10", "--heads", "4"], ["--d-model", "multiple of --heads"]),
])
def test_the_train_lesson_checks_its_text_before_training(tmp_path, capsys, argv, words):
    files = {"BINARY": tmp_path / "image.png", "SHORT": tmp_path / "short.txt", "FOLDER": tmp_path,
             "MISSING": tmp_path / "missing.txt"}
    files["BINARY"].write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    files["SHORT"].write_text("hello\n")  # 6 byte tokens: at most a 5-token window
    argv = [str(files.get(a, a)) for a in argv]
    line = refused(train_lesson.prepare, argv, capsys)
    for w in words:
        assert w in line, f"{w!r} not in {line!r}"


def test_the_train_lesson_accepts_a_text_just_one_window_long(tmp_path):
    path = tmp_path / "six.txt"
    path.write_text("héllo")  # 6 UTF-8 bytes: one window of block 5 (+1 target)
    args, data = train_lesson.prepare(["--text", str(path), "--block", "5"])
    assert len(data) == 1 and os.path.samefile(args.text, path)


def test_worst_fails_a_nan_that_max_would_skip():
    assert max(0.0, float("nan")) == 0.0  # the trap: a check `max(diffs) <= tol` passes on a NaN
    assert cli.worst(0.0, float("nan")) != cli.worst(0.0, float("nan"))  # NaN
    assert not cli.worst([1e-9, float("nan"), 1e-9]) <= 1e-3
    assert cli.worst(0.5, [0.25, 2.0], (x for x in [1.0])) == 2.0
    assert cli.worst() == 0.0


def test_a_lesson_whose_losses_turn_nan_fails():
    """lr 1e308 makes every loss NaN after a step: the loss check must say FAIL and exit 1."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    argv = ["--ranks", "2", "--lr", "1e308", "--layers", "1", "--dim", "8", "--seq", "4", "--batch", "1",
            "--steps", "7"]
    out = subprocess.run([sys.executable, "-m", "minidist.lessons.mixed_precision", *argv],
                         capture_output=True, text=True, timeout=300, cwd=root,
                         env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 1, out.stdout + out.stderr
    verdicts = [line for line in out.stdout.splitlines() if "relative loss difference" in line]
    assert len(verdicts) == 3 and all("nan" in v and v.endswith("FAIL") for v in verdicts), verdicts


def test_the_tpu_lesson_refuses_a_negative_seed_in_one_line():
    """``--seed -1`` reached the data loader and ended in its traceback."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-m", "minidist.lessons.tpu", "--seed", "-1"], capture_output=True,
                         text=True, timeout=300, cwd=root, env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1].endswith("argument --seed: must be an integer >= 0, got -1")
