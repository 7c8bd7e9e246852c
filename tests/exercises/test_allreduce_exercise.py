"""CI for the allreduce grader (minidist/grading/allreduce.py): minidist's own answer gets full marks, every
broken version in its BROKEN fails its task with a message, the untouched exercises/allreduce.py scores 0."""

import types

import pytest

from minidist.grade import grade
from minidist.grading import allreduce as G
from minidist.grading import grader_tests

test_reference_passes, test_broken_implementation_fails, test_grade_reports_the_stub_as_not_written = \
    grader_tests("allreduce", G.CHECKS, G.reference, G.BROKEN)


@pytest.mark.parametrize("task,right", [(t, f) for t, fs in G.ACCEPTED.items() for f in fs],
                         ids=lambda v: getattr(v, "__name__", v))
def test_other_correct_conventions_pass(task, right):
    """Ending the reduce-scatter owning chunk r+1, or a leftward ring, is as right as the spec's ring."""
    G.CHECKS[task](types.SimpleNamespace(**{task: right}))


@pytest.mark.parametrize("task,wrong,words", [
    ("tree_broadcast", G._tree_broadcast_nearest_first, ["at p=8", "took 6 communication rounds",
                                                         "at most 3"]),
    ("ring_all_reduce", G._ring_even_sends_first, ["communication rounds", "sendrecv"]),
    ("ring_all_reduce", G._ring_in_place, ["changed the caller's input x", "np.array_split returns views"]),
], ids=["tree_6_rounds", "ring_two_rounds_a_step", "ring_writes_input"])
def test_the_failure_names_the_problem(task, wrong, words):
    with pytest.raises(AssertionError) as e:
        G.CHECKS[task](types.SimpleNamespace(**{task: wrong}))
    for w in words:
        assert w in str(e.value), (w, str(e.value))


CRASH = '''import numpy as np


def ring_all_reduce(comm, x):
    chunks = np.array_split(x, comm.size)
    return np.concatenate([chunk for c in chunks])


def recursive_doubling_all_reduce(comm, x):
    assert comm.size > 100, "my own check"


def tree_broadcast(comm, x, root=0):
    raise NotImplementedError
'''


def test_a_crash_shows_the_students_file_and_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "exercises").mkdir()
    (tmp_path / "exercises" / "allreduce.py").write_text(CRASH)
    monkeypatch.chdir(tmp_path)
    assert grade("allreduce", "exercises/allreduce.py") == (0, 3)
    out = capsys.readouterr().out
    ring = out.split("recursive_doubling")[0]
    assert "NameError: name 'chunk' is not defined" in ring, out
    assert "at exercises/allreduce.py:6 in ring_all_reduce: return np.concatenate" in ring, out
    assert "grading" not in ring and "runner.py" not in ring, "only the student's frames are shown"
    doubling = out.split("recursive_doubling_all_reduce", 1)[1].split("tree_broadcast")[0]
    assert "AssertionError at exercises/allreduce.py:10 in recursive_doubling_all_reduce" in doubling, out
