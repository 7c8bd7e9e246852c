"""Every file, folder and ``minidist.`` name that README.md and the chapters (lessons/*.md) cite exists.

A chapter that points a reader at ``tests/parallel/test_three_d.py`` or ``minidist.plan.calibrate``
is only useful while that file or name is there; code moves (a layout change moves dozens of files
at once) and prose is not imported by anything, so nothing else would notice. This test reads the
documents and checks each citation:

- a path that starts with ``minidist/``, ``tests/``, ``exercises/``, ``benchmarks/`` or ``lessons/``
  (a file, or a folder when it ends in ``/``) exists relative to the repository root, and a test
  named after it (``tests/comm/test_ledger.py::test_ring_uneven_chunks_formula``) is defined there;
- a dotted ``minidist.a.b.c`` resolves: the longest importable prefix is imported and the rest is
  looked up with getattr (``minidist.comm.transports.devices.jax_distributed_init``).

Templates are skipped: a citation with an all-caps placeholder (``exercises/NAME.py``,
``lessons/NN-*.md``), a ``*`` or ``<...>``. Inside a fenced code block only command lines are read
(a line that starts, after an optional ``$``, with ``python``, ``mpirun``, ``pip``, ``env`` or a
``VAR=value`` assignment); the other lines of a fence are a program's example output, whose log
prefixes (``[minidist.faults]``) and printed names are not citations.

The course table is checked too: every lesson module and every exercise appears in README.md with
the command that runs it.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "lessons").glob("*.md"))]

PATH = re.compile(r"(?<![\w./-])((?:minidist|tests|exercises|benchmarks|lessons)/[\w./*<>-]*)(?:::(\w+))?")
NAME = re.compile(r"(?<![\w./-])(minidist(?:\.\w+)+)")
COMMAND = re.compile(r"^\s*(?:\$\s+)?(?:python|mpirun|pip|env\s|[A-Z_][A-Z0-9_]*=)")
TEMPLATE = re.compile(r"[*<>]|(?:^|[/._-])[A-Z]{2,}(?:$|[/._-])")


def cited_lines(text: str):
    """(line number, line) of every line whose citations count: prose, and commands in fences."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced or COMMAND.match(line):
            yield number, line


def citations(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(paths, dotted names) cited in ``text``, each with its line number; templates left out."""
    paths, names = [], []
    for number, line in cited_lines(text):
        for m in PATH.finditer(line):
            p = m.group(1).rstrip(".,;:")
            if not TEMPLATE.search(p):
                paths.append((number, p if m.group(2) is None else f"{p}::{m.group(2)}"))
        for m in NAME.finditer(line):
            n = m.group(1).rstrip(".")
            if not TEMPLATE.search(n):
                names.append((number, n))
    return paths, names


def resolve(name: str) -> str | None:
    """None when ``name`` is an importable module or an attribute of one; else what is missing."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        module = ".".join(parts[:k])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is not None and not module.startswith(e.name):
                return f"importing {module} failed: {e}"  # a real import error, not a missing module
            continue
        for attr in parts[k:]:
            if not hasattr(obj, attr):
                return f"{module} has no attribute {'.'.join(parts[k:])!r}"
            obj = getattr(obj, attr)
        return None
    return f"no module {parts[0]}"


def missing_path(cited: str, root: Path) -> str | None:
    """None when the cited file, folder or ``file.py::test`` exists under ``root``; else what is missing."""
    path, _, test = cited.partition("::")
    if path.endswith("/"):
        return None if (root / path).is_dir() else f"no such folder {path}"
    if not (root / path).is_file():
        return f"no such file {path}"
    if test and not re.search(rf"^\s*def {test}\(", (root / path).read_text(), re.M):
        return f"{path} defines no {test}"
    return None


def stale(path: Path, root: Path = ROOT) -> list[str]:
    """'file:line: what' for every citation in the document at ``path`` that does not exist."""
    paths, names = citations(path.read_text())
    where = path.relative_to(root) if path.is_relative_to(root) else path
    bad = [f"{where}:{n}: {why}" for n, p in paths if (why := missing_path(p, root))]
    bad += [f"{where}:{n}: {n_}: {why}" for n, n_ in names if (why := resolve(n_))]
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_citation_exists(doc):
    bad = stale(doc)
    assert not bad, "stale citations:\n" + "\n".join(bad)


def test_a_stale_citation_is_caught(tmp_path):
    doc = tmp_path / "chapter.md"
    doc.write_text(
        "The ring is in `minidist/comm/collectives.py` and `minidist/comm/` (see `tests/test_ring.py`,\n"
        "`tests/comm/test_ledger.py::test_ring_uneven_chunks_formula`,\n"
        "`tests/comm/test_ledger.py::test_gone`,\n"
        "`minidist/comms/`).\n"
        "`minidist.comm.collectives.ring_all_reduce` is real; `minidist.comm.collectives.ring_allreduce`\n"
        "and `minidist.nowhere` are not. `exercises/NAME.py` is a template.\n"
        "```\n"
        "[minidist.faults] rank 3: injected (example output: not a citation) tests/gone.py\n"
        "python -m minidist.lessons.nosuch   # a command: checked\n"
        "```\n")
    bad = stale(doc, root=ROOT)
    assert [b.split(": ", 1)[1] for b in bad] == [
        "no such file tests/test_ring.py",
        "tests/comm/test_ledger.py defines no test_gone",
        "no such folder minidist/comms/",
        "minidist.comm.collectives.ring_allreduce: minidist.comm.collectives has no attribute "
        "'ring_allreduce'",
        "minidist.nowhere: minidist has no attribute 'nowhere'",
        "minidist.lessons.nosuch: minidist.lessons has no attribute 'nosuch'",
    ]


def test_course_table_has_every_lesson_and_exercise():
    readme = (ROOT / "README.md").read_text()
    lessons = sorted(p.stem for p in (ROOT / "minidist" / "lessons").glob("*.py")
                     if "def main(" in p.read_text())
    exercises = sorted(p.stem for p in (ROOT / "exercises").glob("*.py") if not p.stem.startswith("_"))
    assert len(lessons) >= 15 and len(exercises) >= 15
    missing = [f"python -m minidist.lessons.{n}" for n in lessons if f"minidist.lessons.{n}`" not in readme
               and f"minidist.lessons.{n} " not in readme]
    missing += [f"python -m minidist.grade {n}" for n in exercises
                if f"python -m minidist.grade {n}`" not in readme]
    assert not missing, "README's course table lacks: " + ", ".join(missing)
