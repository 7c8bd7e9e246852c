"""Grade an exercise: ``python -m minidist.grade NAME [--file exercises/NAME.py] [-v]``;
``python -m minidist.grade --list``: every exercise, its topic, estimated time and your score.

An exercise ``NAME`` is a student file ``exercises/NAME.py`` (functions with a spec and a
``NotImplementedError`` body; its docstring's first line names the topic, an ``Estimated time:``
line the time) and a grader, the module ``minidist.grading.NAME`` (minidist/grading/NAME.py), whose
``CHECKS`` dict maps each task (function name) to ``check(impl)``: property tests that raise
AssertionError when ``impl.<task>`` is wrong, and an optional ``POINTS`` dict (task -> points,
default 1). The graders ship with the package (they import nothing from tests/), so an installed
minidist grades without the test suite; CI (tests/exercises/) runs the same checks against
minidist's own implementation (``reference()``: must pass) and the broken ones in ``BROKEN`` (must fail).

A failed task prints what failed -- the example (world size, sizes, dtype, rank) and the first
elements that differ, from the grader's message and hypothesis's falsifying example; a crash in the
student's code (or a failed ``assert`` of theirs) adds where in their file, ``exercises/NAME.py:LINE
in FUNC: source``, their frames only; ``-v`` adds the traceback. Exit status: 0 every task passed,
1 some failed, 2 the file could not be graded (missing, not Python, ends the process or hangs while
imported, or a task still running after ``--timeout`` seconds), with one line saying which.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import math
import os
import re
import signal
import sys
import threading
import traceback
from importlib.machinery import SourceFileLoader
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the suggested order (README's course table); exercises not named here follow, alphabetically
COURSE = ["autograd", "allreduce", "data_parallel", "zero", "tensor_parallel", "collective_matmul",
          "pipeline", "zero_bubble", "checkpointing", "mixed_precision", "fp8", "offload", "kv_cache",
          "speculative", "three_d", "fault_tolerance", "live_recovery", "compression", "load_balancing",
          "long_context", "moe"]
MAX_LINES = 12  # lines of a failure's message shown without -v


class GradeError(Exception):
    """The student's file could not be graded (missing, not Python, exits or hangs at import, a task
    that never ends): ``main`` prints the message and exits with status 2."""


class _Exited(BaseException):
    """Raised in place of ``os._exit`` while a student's code runs (so the grader can say so)."""

    def __init__(self, code):
        super().__init__(code)
        self.code = code


class _TimedOut(BaseException):
    pass


@contextlib.contextmanager
def guarded(seconds: float | None):
    """While the student's code runs: ``os._exit`` raises ``_Exited`` instead of ending the grader,
    and after ``seconds`` (main thread, POSIX) ``_TimedOut`` interrupts it."""
    real = os._exit

    def no_exit(code=0):
        raise _Exited(code)

    def alarm(signum, frame):
        raise _TimedOut()

    timer = bool(seconds) and threading.current_thread() is threading.main_thread() and hasattr(signal,
                                                                                                "setitimer")
    if timer:
        previous = signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
    os._exit = no_exit
    try:
        yield
    finally:
        os._exit = real
        if timer:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def load_module(path: Path, name: str, timeout: float | None = None):
    """Import the student's file, or a GradeError saying why it can't be graded."""
    if not path.is_file():
        raise GradeError(f"no such file: {path}" if not path.exists() else f"{path} is a folder, not a file")
    # read as Python source whatever its name (a file without .py has no loader of its own)
    spec = importlib.util.spec_from_file_location(name, path, loader=SourceFileLoader(name, str(path)))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        with guarded(timeout):
            spec.loader.exec_module(mod)
    except (SyntaxError, UnicodeDecodeError, ValueError) as e:  # ValueError: null bytes in source
        if isinstance(e, SyntaxError):
            e = f"{type(e).__name__}{f' at line {e.lineno}' if e.lineno else ''}: {e.msg}"
        raise GradeError(f"{path} is not Python ({e}); give the exercise's .py file") from None
    except (SystemExit, _Exited) as e:
        call = f"sys.exit({e.code!r})" if isinstance(e, SystemExit) else f"os._exit({e.code})"
        raise GradeError(f"{path} called {call} while being imported: a student file defines the "
                         "exercise's functions and must not end the process (guard scripts with "
                         "`if __name__ == \"__main__\":`)") from None
    except _TimedOut:
        raise GradeError(f"{path} did not finish importing within --timeout {timeout:g} s "
                         "(an infinite loop at module level?)") from None
    except Exception as e:
        raise GradeError(f"{path} raised {type(e).__name__} while being imported: {e}") from None
    return mod


def grader_path(name: str) -> Path:
    """The grader of exercise ``name``: minidist/grading/NAME.py."""
    return ROOT / "minidist" / "grading" / f"{name}.py"


def exercises() -> list[str]:
    """Every exercise with a student file and a grader, in the suggested order."""
    names = {p.stem for p in (ROOT / "exercises").glob("*.py") if not p.stem.startswith("_")}
    names = {n for n in names if grader_path(n).exists()}
    return [n for n in COURSE if n in names] + sorted(names - set(COURSE))


def header(name: str) -> tuple[str, str]:
    """(topic, estimated time) from exercises/NAME.py's docstring."""
    text = (ROOT / "exercises" / f"{name}.py").read_text()
    m = re.search(r'"""(?:Exercise [^:]*:\s*)?(.*?)\n', text)
    topic = m.group(1).strip().rstrip(".") if m else ""
    t = re.search(r"Estimated time:\s*(.+)", text)
    return topic, (t.group(1).split("(")[0].strip() if t else "?")  # "1 h (parts...)" -> "1 h"


def _explain(e: BaseException, verbose: bool) -> str:
    """The failure as a student needs it: the grader's message and hypothesis's example."""
    lines = str(e).strip().splitlines() or ["assertion failed"]
    notes = [n.replace("prop(", "(").replace("Failing test case", "Falsifying example")
             for n in getattr(e, "__notes__", []) if "Falsifying" in n or "Failing test case" in n]
    shown = lines if verbose else lines[:MAX_LINES] + (["..."] if len(lines) > MAX_LINES else [])
    for note in notes:
        shown += note.strip().splitlines()
    return "\n".join(shown)


def _student_lines(e: BaseException, path: Path) -> list[str]:
    """Where in the student's file ``e`` came from: ``exercises/NAME.py:LINE in FUNC: source`` for
    each of its traceback's frames in that file (outermost first; a comprehension's frame on the same
    line once); [] when none is there."""
    target = os.path.realpath(path)
    frames = [f for f in traceback.extract_tb(e.__traceback__) if os.path.realpath(f.filename) == target]
    frames = [f for k, f in enumerate(frames) if not k or f.lineno != frames[k - 1].lineno]
    shown = Path(os.path.relpath(target))
    shown = shown if not shown.parts or shown.parts[0] != ".." else path
    return [f"{shown}:{f.lineno} in {f.name}: {(f.line or '').strip()}" for f in frames]


TIMEOUT = 600.0  # seconds a task (or the import) may run before it is called a hang


def grade(name: str, student_file: str | None = None, verbose: bool = False,
          out=None, timeout: float | None = TIMEOUT) -> tuple[int, int]:
    """Run every check of exercise ``name`` on the student's file; print and return (passed, total).
    A task that runs past ``timeout`` seconds FAILs and stops the grading (GradeError); a task that
    exits (``sys.exit``, ``os._exit``) FAILs."""
    out = out or sys.stdout
    if not grader_path(name).exists():
        raise SystemExit(f"no grader for exercise {name!r}: expected {grader_path(name)}")
    grader = importlib.import_module(f"minidist.grading.{name}")
    path = Path(student_file) if student_file else ROOT / "exercises" / f"{name}.py"
    student = load_module(path, f"student_{name}", timeout)
    points = getattr(grader, "POINTS", {})
    passed = got = 0
    worth = sum(points.get(t, 1) for t in grader.CHECKS)
    print(f"exercise {name}: {len(grader.CHECKS)} tasks, {worth} points", file=out)
    for task, check in grader.CHECKS.items():
        detail, hung = "", False
        try:
            with guarded(timeout):
                check(student)
        except _TimedOut:
            verdict, detail, hung = "FAIL", f"still running after --timeout {timeout:g} s: stopped", True
        except (SystemExit, _Exited) as e:
            call = f"sys.exit({e.code!r})" if isinstance(e, SystemExit) else f"os._exit({e.code})"
            verdict, detail = "FAIL", f"the code called {call} instead of returning"
        except NotImplementedError:
            verdict = "not written yet"
        except AssertionError as e:  # the grader's check (or an assert in the student's code: say where)
            where = _student_lines(e, path)[-1:]
            verdict, detail = "FAIL", "\n".join(([f"AssertionError at {where[0]}"] if where else [])
                                                + [_explain(e, verbose)])
            if verbose:
                traceback.print_exc()
        except Exception as e:  # a crash in the student's code is a failed task, not a crashed grader
            verdict, detail = "FAIL", "\n".join([f"{type(e).__name__}: {_explain(e, verbose)}"]
                                                + [f"  at {w}" for w in _student_lines(e, path)])
            if verbose:
                traceback.print_exc()
        else:
            verdict = "PASS"
            passed += 1
            got += points.get(task, 1)
        print(f"  {task:<36} {verdict}  ({points.get(task, 1)} pt)", file=out)
        for line in detail.splitlines():
            print(f"      {line}", file=out)
        if hung:
            raise GradeError(f"task {task} of exercise {name} ran longer than --timeout {timeout:g} s (an "
                             f"infinite loop, or a deadlock?); score so far: {passed} of "
                             f"{len(grader.CHECKS)} tasks")
    print(f"score: {passed}/{len(grader.CHECKS)} tasks, {got}/{worth} points", file=out)
    return passed, len(grader.CHECKS)


def listing() -> list[tuple[str, str, str, str]]:
    """(name, topic, time, score) for every exercise, running each grader quietly on your file."""
    rows = []
    for name in exercises():
        topic, time = header(name)
        try:
            passed, total = grade(name, out=io.StringIO())
            score = f"{passed}/{total}"
        except BaseException as e:  # a broken student file must not hide the other rows
            score = f"error: {type(e).__name__}"
        rows.append((name, topic, time, score))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m minidist.grade",
                                 description="Grade an exercise with its property tests.")
    ap.add_argument("name", nargs="?", help="the exercise (see --list)")
    ap.add_argument("--list", action="store_true", help="every exercise, topic, estimated time, your score")
    ap.add_argument("--file", help="the student's file (default: exercises/NAME.py)")
    ap.add_argument("-v", "--verbose", action="store_true", help="full messages and tracebacks of failures")
    ap.add_argument("--timeout", type=float, default=TIMEOUT,
                    help=f"seconds a task may run before it counts as hung (default {TIMEOUT:g})")
    args = ap.parse_args(argv)
    if args.list:
        rows = listing()
        print(f"{'exercise':<17} {'time':<11} {'score':<7} topic")
        for name, topic, time, score in rows:
            print(f"{name:<17} {time:<11} {score:<7} {topic}")
        print("score: tasks passed by your exercises/NAME.py; grade one with python -m minidist.grade NAME")
        return
    if args.name is None:
        ap.error("name an exercise to grade, or --list to see them all with your scores")
    if args.name not in exercises():
        ap.error(f"unknown exercise {args.name!r}: choose one of {', '.join(exercises())} (or --list)")
    if not args.timeout > 0 or not math.isfinite(args.timeout):
        ap.error(f"argument --timeout: must be a finite number of seconds > 0, got {args.timeout}")
    try:
        passed, total = grade(args.name, args.file, args.verbose, timeout=args.timeout)
    except GradeError as e:
        print(f"minidist.grade: {e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(0 if passed == total else 1)


if __name__ == "__main__":
    main()
