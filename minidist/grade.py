"""Grade an exercise: ``python -m minidist.grade NAME [--file exercises/NAME.py]``.

An exercise ``NAME`` is a student file ``exercises/NAME.py`` (functions with a spec and a
``NotImplementedError`` body) and a grader ``tests/exercises/test_NAME_exercise.py`` whose
``CHECKS`` dict maps each task (function name) to ``check(impl)``: property tests that raise
AssertionError when ``impl.<task>`` is wrong. The same checks run in CI against minidist's own
implementation (they must pass) and against deliberately broken ones (they must fail).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_module(path: Path, name: str):
    if not path.exists():
        raise SystemExit(f"no such file: {path}")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def exercises() -> list[str]:
    return sorted(p.stem for p in (ROOT / "exercises").glob("*.py") if not p.stem.startswith("_"))


def grade(name: str, student_file: str | None = None, verbose: bool = False) -> tuple[int, int]:
    """Run every check of exercise ``name`` on the student's file; print and return (passed, total)."""
    grader = load_module(ROOT / "tests" / "exercises" / f"test_{name}_exercise.py", f"grader_{name}")
    student = load_module(Path(student_file) if student_file else ROOT / "exercises" / f"{name}.py",
                          f"student_{name}")
    passed = 0
    print(f"exercise {name}: {len(grader.CHECKS)} tasks")
    for task, check in grader.CHECKS.items():
        try:
            check(student)
        except NotImplementedError:
            verdict = "not written yet"
        except AssertionError as e:
            first = str(e).strip().splitlines()
            verdict = "FAIL: " + (first[0] if first else "assertion failed")
            if verbose:
                traceback.print_exc()
        except Exception as e:  # a crash in the student's code is a failed task, not a crashed grader
            verdict = f"FAIL: {type(e).__name__}: {e}"
            if verbose:
                traceback.print_exc()
        else:
            verdict = "PASS"
            passed += 1
        print(f"  {task:<36} {verdict}")
    print(f"score: {passed}/{len(grader.CHECKS)}")
    return passed, len(grader.CHECKS)


# -- what every grader shares ------------------------------------------------------------------

class RanksHung(BaseException):
    """Ranks stuck waiting on each other. A BaseException, so hypothesis stops at once instead of
    shrinking an example that takes ``wait_s`` seconds per try."""


def run_guarded(body, ranks: int, wait_s: float = 10):
    """``minidist.comm.run(body, ranks)`` with every wait bounded by ``wait_s`` seconds: a student's
    collective that leaves a rank waiting fails the task in seconds, not after the 300 s default."""
    from minidist.comm import CollectiveMismatch, CommTimeout, RankExited, run

    def guarded(comm):
        comm.timeout = wait_s
        return body(comm)
    try:
        return run(guarded, ranks=ranks)
    except (CommTimeout, RankExited, CollectiveMismatch) as e:  # would wait forever, caught early or not
        raise RanksHung(str(e).splitlines()[0]) from None


def no_hang(prop) -> None:
    """Run a property; ranks that hung become a failed check that says so."""
    try:
        prop()
    except RanksHung as e:
        raise AssertionError(f"the ranks hung (do all ranks make the same collectives?): {e}") from None


def grader_tests(name: str, checks: dict, reference, broken: dict):
    """The three pytest tests every grader runs in CI: minidist's own ``reference()`` passes every
    check, each deliberately ``broken`` version fails its task's check, and the untouched stub in
    exercises/NAME.py scores 0, reported as "not written yet". Assign them to ``test_*`` names."""
    import types

    import pytest

    @pytest.mark.parametrize("task", list(checks))
    def test_reference_passes(task):
        checks[task](reference())

    @pytest.mark.parametrize("task,wrong", [(t, b) for t, bs in broken.items() for b in bs],
                             ids=lambda v: getattr(v, "__name__", v))
    def test_broken_implementation_fails(task, wrong):
        with pytest.raises(AssertionError):
            checks[task](types.SimpleNamespace(**{task: wrong}))

    def test_grade_reports_the_stub_as_not_written(capsys):
        assert grade(name) == (0, len(checks))
        assert capsys.readouterr().out.count("not written yet") == len(checks)

    return test_reference_passes, test_broken_implementation_fails, test_grade_reports_the_stub_as_not_written


def main(argv=None):
    ap = argparse.ArgumentParser(description="Grade an exercise with its property tests.")
    ap.add_argument("name", choices=exercises())
    ap.add_argument("--file", help="the student's file (default: exercises/NAME.py)")
    ap.add_argument("-v", "--verbose", action="store_true", help="show tracebacks of failures")
    args = ap.parse_args(argv)
    passed, total = grade(args.name, args.file, args.verbose)
    sys.exit(0 if passed == total else 1)


if __name__ == "__main__":
    main()
