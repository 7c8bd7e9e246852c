"""Lesson 1's flags (minidist.lessons.train_cli): each bad value exits with status 2 and one line
naming the flag, before the lesson prints or trains anything."""

import pytest

from minidist.lessons import train as lesson


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
