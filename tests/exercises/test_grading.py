"""The grader itself: the rendezvous transport catches a blocking ring, a failure teaches, --list lists."""

import ast
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest

import minidist.comm as C
from minidist.grade import ROOT, exercises, grade, listing
from minidist.grading.rendezvous import Deadlock, run_rendezvous


def _blocking_ring(comm):
    comm.send(np.full(3, comm.rank, np.float64), (comm.rank + 1) % comm.size)
    return comm.recv((comm.rank - 1) % comm.size)


@pytest.mark.parametrize("p", [2, 4])
def test_a_blocking_send_then_recv_ring_is_a_deadlock_naming_the_cycle(p):
    start = time.monotonic()
    with pytest.raises(Deadlock) as e:
        run_rendezvous(_blocking_ring, p)
    assert time.monotonic() - start < 3, "seen in a fraction of a second, not at the watchdog"
    msg = str(e.value)
    for r in range(p):  # every rank of the cycle, waiting in its send to the next
        assert f"rank {r} waits in send to rank {(r + 1) % p}" in msg, msg


def test_the_same_ring_passes_on_the_buffered_threads_transport():
    from minidist.comm import run  # the reason the grader needs rendezvous: buffered sends hide it

    assert [int(y[0]) for y in run(_blocking_ring, ranks=3)] == [2, 0, 1]


def _even_sends_first(comm):
    x = np.full(2, comm.rank, np.float64)
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    if comm.rank % 2 == 0:
        comm.send(x, right)
        return comm.recv(left)
    y = comm.recv(left)
    comm.send(x, right)
    return y


@pytest.mark.parametrize("fn", [
    lambda c: c.sendrecv(np.full(2, c.rank, np.float64), (c.rank + 1) % c.size, (c.rank - 1) % c.size),
    _even_sends_first,
], ids=["sendrecv", "even_first"])
def test_deadlock_free_rings_complete(fn):
    out = run_rendezvous(fn, 4)
    assert [int(y[0]) for y in out] == [3, 0, 1, 2]


@pytest.mark.parametrize("coll", [C.ring_all_reduce, C.recursive_doubling_all_reduce, C.tree_all_reduce,
                                  C.two_shot_all_reduce, C.halving_doubling_all_reduce, C.naive_all_reduce])
def test_minidist_all_reduces_are_deadlock_free_when_sends_rendezvous(coll):
    xs = [np.arange(7.0) * (r + 1) for r in range(5)]
    for y in run_rendezvous(lambda c: coll(c, xs[c.rank]), 5):
        np.testing.assert_array_equal(y, np.arange(7.0) * 15)


def test_minidist_other_collectives_are_deadlock_free_when_sends_rendezvous():
    p = 3
    out = run_rendezvous(lambda c: (C.broadcast(c, np.arange(3.0) if c.rank == 2 else None, 2),
                                    C.all_gather(c, np.full(2, float(c.rank))),
                                    C.reduce_scatter(c, np.arange(6.0)),
                                    C.all_to_all(c, np.arange(2.0 * p).reshape(p, 2) + 10 * c.rank)), p)
    for r, (b, g, rs, a2a) in enumerate(out):
        np.testing.assert_array_equal(b, np.arange(3.0))
        np.testing.assert_array_equal(g, np.repeat(np.arange(3.0), 2))
        np.testing.assert_array_equal(rs, 3 * np.arange(6.0)[2 * r:2 * r + 2])
        sent_to_me = [np.arange(2.0 * p).reshape(p, 2)[r] + 10 * q for q in range(p)]  # row r of rank q
        np.testing.assert_array_equal(a2a, np.stack(sent_to_me))


def test_a_receive_from_a_rank_that_sends_elsewhere_is_a_cycle_too():
    def body(comm):  # rank 0 waits for 1's message; 1 waits in a send to 0, which posted no receive (tag)
        if comm.rank == 0:
            return comm.recv(1, tag=5)
        comm.send(np.ones(2), 0, tag=6)
    with pytest.raises(Deadlock, match="rank 0 waits in receive from rank 1"):
        run_rendezvous(body, 2)


WRONG = '''
import numpy as np
def ring_all_reduce(comm, x):
    return x * comm.size  # right only when every rank holds the same x
def recursive_doubling_all_reduce(comm, x):
    raise NotImplementedError
def tree_broadcast(comm, x, root=0):
    raise NotImplementedError
'''


def test_a_failure_prints_the_example_rank_and_first_differing_elements(tmp_path, capsys):
    f = tmp_path / "allreduce.py"
    f.write_text(WRONG)
    assert grade("allreduce", str(f)) == (0, 3)
    out = capsys.readouterr().out
    fail = out.split("ring_all_reduce")[1].split("recursive_doubling")[0]
    assert "FAIL" in fail, out
    for word in ("rank 0 of 3 ranks", "n=4", "elements differ", "[0] expected", "got", "float64"):
        assert word in fail, (word, out)


def test_list_shows_every_exercise_with_topic_time_and_score():
    rows = {name: (topic, time, score) for name, topic, time, score in listing()}
    stubs = {p.stem for p in (ROOT / "exercises").glob("*.py") if not p.stem.startswith("_")}
    assert len(stubs) >= 16 and set(rows) == set(exercises()) == stubs, "every exercise needs a grader"
    assert all(topic for topic, _, _ in rows.values())
    assert rows["allreduce"][2] == "0/3"


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import in a file, at any depth (function-local ones too)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out += [(node.lineno, node.module or "")]
    return out


def imports_named(root: Path, top: str) -> list[str]:
    """``file:line: module`` for every import of package ``top`` (or a submodule) in the files under root."""
    return [f"{p.relative_to(root.parent)}:{n}: {m}" for p in sorted(root.rglob("*.py"))
            for n, m in imports_of(p) if m == top or m.startswith(top + ".")]


def test_the_library_never_imports_the_test_suite():
    """An installed minidist has no tests/: the graders and everything else must work without it."""
    assert not imports_named(ROOT / "minidist", "tests")


def test_graders_never_import_pytest():
    """A student grades with plain python; only grader_tests (CI's helper) may load pytest."""
    bad = [hit for hit in imports_named(ROOT / "minidist", "pytest")
           if not hit.startswith("minidist/grading/__init__.py:")]
    assert not bad


def test_the_import_scan_finds_a_planted_tests_import(tmp_path):
    pkg = tmp_path / "minidist"
    (pkg / "grading").mkdir(parents=True)
    (pkg / "grading" / "moe.py").write_text("import numpy\ndef f():\n    from tests.exercises import x\n")
    (pkg / "ok.py").write_text("import testsuite\nfrom . import tests\n")
    assert imports_named(pkg, "tests") == ["minidist/grading/moe.py:3: tests.exercises"]


# student files the grader cannot grade (exit status 2, one line saying why) or whose task ends the
# process or never returns; each run as `python -m minidist.grade allreduce --file X --timeout T`,
# T = 2 s for the files that loop (the time is the point) and 60 s for the rest, whose tasks end on
# their own: on a loaded machine the other tasks' failing examples can take more than 2 s to shrink
# (each run of ranks starts threads), which would turn the exit status 1 into 2
UNGRADABLE = [
    ("exit_at_import.py", "import sys\nsys.exit(0)\n", 2, ["called sys.exit(0) while being imported"]),
    ("os_exit_at_import.py", "import os\nos._exit(0)\n", 2, ["called os._exit(0) while being imported"]),
    ("picture.py", b"\x89PNG\r\n\x1a\n\x00\x01", 2, ["is not Python", "null bytes"]),
    ("true", open("/bin/true", "rb").read(), 2, ["is not Python", "null bytes"]),  # a program, not .py
    ("notes.txt", "def ring_all_reduce(comm, x)\n", 2, ["is not Python", "SyntaxError at line 1"]),
    ("typo.py", "def ring_all_reduce(comm, x)\n    return x\n", 2,
     ["is not Python", "SyntaxError at line 1"]),
    ("loop_at_import.py", "while True:\n    pass\n", 2, ["did not finish importing within --timeout 2 s"]),
    ("loop_in_task.py", "def ring_all_reduce(comm, x):\n    while True:\n        pass\n", 2,
     ["task ring_all_reduce", "longer than --timeout 2 s", "score so far: 0 of 3"]),
    ("exit_in_task.py", "import sys\ndef ring_all_reduce(comm, x):\n    sys.exit(0)\n", 1,
     ["score: 0/3"]),
    ("os_exit_in_task.py", "import os\ndef ring_all_reduce(comm, x):\n    os._exit(0)\n", 1, ["score: 0/3"]),
    ("missing.py", None, 2, ["no such file"]),
]


@pytest.mark.parametrize("fname,text,code,words", UNGRADABLE, ids=[u[0] for u in UNGRADABLE])
def test_the_grader_exit_status_tells_the_truth_about_a_broken_student_file(tmp_path, fname, text, code,
                                                                            words):
    import subprocess
    import sys

    f = tmp_path / fname
    if isinstance(text, bytes):
        f.write_bytes(text)
    elif text is not None:
        f.write_text(text)
    limit = "2" if fname.startswith("loop") else "60"  # only a loop waits for it (load slows the rest)
    out = subprocess.run([sys.executable, "-m", "minidist.grade", "allreduce", "--file", str(f), "--timeout",
                          limit], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == code, (out.returncode, out.stdout, out.stderr)
    shown = out.stdout + out.stderr
    for w in words:
        assert w in shown, (w, shown)
    if code == 2:
        assert out.stderr.strip().splitlines()[-1].startswith("minidist.grade: ")


TIME = re.compile(r"\d+(\.\d+)?(-\d+)? h( \d+ min)?|\d+ min")  # "1.5 h", "2-3 h", "1 h 15 min", "45 min"


def test_list_gives_every_exercise_a_time_in_one_unit_style(capsys, monkeypatch):
    import minidist.grade as G

    times = {name: G.header(name)[1] for name in exercises()}
    bad = {n: t for n, t in times.items() if not TIME.fullmatch(t)}
    assert not bad, f"estimated times not in the style '45 min' / '1.5 h' / '1 h 15 min': {bad}"
    monkeypatch.setattr(G, "grade", lambda name, **kw: (0, 1))  # the table, not the grading (tested above)
    G.main(["--list"])
    out = capsys.readouterr().out
    assert "minutes" not in out and "hours" not in out and " ? " not in out, out
    for name, t in times.items():
        assert re.search(rf"^{name} +{re.escape(t)} +0/1 ", out, re.M), (name, t, out)


def test_readme_course_table_gives_each_exercise_its_files_time():
    """The README's time column lists, in order, the estimate from each named exercise's docstring."""
    from minidist.grade import header

    rows = [line.split("|") for line in (ROOT / "README.md").read_text().splitlines()
            if line.startswith("|") and "minidist.grade " in line]
    assert rows
    for cells in rows:
        names = re.findall(r"minidist\.grade (\w+)", cells[4])
        assert cells[5].strip() == ", ".join(header(n)[1] for n in names), cells


def test_untouched_names_the_argument_and_first_changed_element():
    from minidist.grading import untouched

    def bump(x, ws, table):
        ws[1][0, 2] += 1.0
    with pytest.raises(AssertionError, match=r"bump changed its input ws\[1\]: ws\[1\]\[0, 2\] was 0, "
                                             r"is now 1"):
        untouched(bump)(np.zeros(3), [np.zeros((1, 3)), np.zeros((1, 3))], [4, 5])

    def pop(x, ws, table):
        table.pop()
    with pytest.raises(AssertionError, match=r"changed its input block_table: block_table was \[4, 5\]"):
        untouched(pop, ["x", "ws", "block_table"])(np.zeros(3), [], [4, 5])


def test_untouched_passes_pure_functions_nan_inputs_and_declared_in_place_writes():
    from minidist.autograd.tensor import Tensor
    from minidist.grading import untouched

    x = np.array([np.nan, 1.0])
    np.testing.assert_array_equal(untouched(lambda x, t: x * 2)(x, Tensor(np.ones(2))), [np.nan, 2.0])

    def fill(cache, kv):
        cache[0] = kv
    cache = np.zeros((2, 2))
    untouched(fill, writes=("cache",))(cache, np.ones(2))  # the spec says cache is written: allowed
    np.testing.assert_array_equal(cache[0], [1.0, 1.0])

    def scale(t):
        t.data *= 2
    with pytest.raises(AssertionError, match=r"changed its input t.data: t.data\[0\] was 1, is now 2"):
        untouched(scale)(Tensor(np.ones(2)))
