"""The exercise graders: ``python -m minidist.grade NAME`` (see minidist/grade.py).

One module per exercise, ``minidist/grading/NAME.py``, holds ``CHECKS`` (task -> ``check(impl)``:
property tests that raise AssertionError when ``impl.<task>`` is wrong), optionally ``POINTS``
(task -> points), ``reference()`` (minidist's own answer: must get full marks) and ``BROKEN``
(task -> realistic wrong versions: each must fail), optionally ``ACCEPTED`` (task -> other correct
answers the spec allows: each must pass). CI proves them in tests/exercises/. Where a crash in
the student's code happened (their file and line) is shown by the runner, minidist/grade.py.

This file holds what every grader shares: running ranks with a bound on every wait
(``run_guarded``; ``rendezvous=True`` for point-to-point exercises, see rendezvous.py, with
communication rounds counted, rounds.py), turning hung ranks into a failed check (``no_hang``),
a comparison that teaches (``assert_close``: which rank, sizes, dtype, and the first elements
that differ), the check that a student's function leaves the caller's arrays alone (``untouched``)
and the CI tests (``grader_tests``).
"""

from __future__ import annotations

import numpy as np

from minidist.comm import CollectiveMismatch, CommTimeout, RankExited, run
from minidist.grade import grade
from minidist.grading.rendezvous import Deadlock, run_rendezvous
from minidist.grading.rounds import RoundsComm


class RanksHung(BaseException):
    """Ranks stuck waiting on each other. A BaseException, so hypothesis stops at once instead of
    shrinking an example that takes ``wait_s`` seconds per try."""


def run_guarded(body, ranks: int, wait_s: float = 10, rendezvous: bool = False, comm_class=None):
    """``minidist.comm.run(body, ranks)`` with every wait bounded by ``wait_s`` seconds: a student's
    collective that leaves a rank waiting fails the task in seconds, not after the 300 s default.
    ``rendezvous=True``: sends complete only when the receive is posted (MPI's large messages), and
    a cycle of waiting ranks fails at once, naming the cycle; ``comm.rounds()`` then counts the
    communication rounds this rank has taken part in (rounds.py). ``comm_class``: a RoundsComm
    subclass to run on instead (overlap.py's logs each transfer)."""
    def guarded(comm):
        comm.timeout = wait_s
        return body(comm)
    try:
        if rendezvous or comm_class is not None:
            return run_rendezvous(guarded, ranks, comm_class=comm_class or RoundsComm)
        return run(guarded, ranks=ranks)
    except Deadlock as e:
        raise RanksHung(str(e)) from None
    except (CommTimeout, RankExited, CollectiveMismatch) as e:  # would wait forever, caught early or not
        raise RanksHung(str(e).splitlines()[0]) from None


def no_hang(prop) -> None:
    """Run a property; ranks that hung become a failed check that says so."""
    try:
        prop()
    except RanksHung as e:
        msg = str(e)
        if msg.startswith("deadlock"):
            raise AssertionError(f"the ranks hung in a {msg}") from None
        raise AssertionError(f"the ranks hung (do all ranks make the same collectives?): {msg}") from None


def _fmt(v) -> str:
    return np.format_float_positional(v, precision=6, trim="-") if np.isscalar(v) and np.isreal(v) and \
        not isinstance(v, (bool, np.bool_)) else repr(v)


def assert_close(got, want, where: str, *, rtol: float = 0.0, atol: float = 0.0, show: int = 4) -> None:
    """got == want within ``rtol``/``atol`` (0: exactly), or an AssertionError that teaches:
    ``where`` (say: "rank 2 of 4, n=10"), the shapes and dtypes, how many elements differ and the
    first ``show`` of them as ``[index] expected E, got G``."""
    got_a, want_a = np.asarray(got), np.asarray(want)
    head = f"{where}: "
    if got is None:
        raise AssertionError(head + f"returned None, expected an array of shape {want_a.shape} "
                                    f"{want_a.dtype}")
    if got_a.shape != want_a.shape:
        raise AssertionError(head + f"shape {got_a.shape} ({got_a.dtype}), expected {want_a.shape} "
                                    f"({want_a.dtype})")
    g, w = got_a.astype(np.float64, copy=False), want_a.astype(np.float64, copy=False)
    bad = ~np.isclose(g, w, rtol=rtol, atol=atol, equal_nan=True) if (rtol or atol) else \
        ~((g == w) | (np.isnan(g) & np.isnan(w)))
    n = int(bad.sum())
    if not n:
        return
    first = [tuple(int(i) for i in ix) for ix in np.argwhere(bad)[:show]]
    shown = "; ".join(f"[{', '.join(map(str, ix))}] expected {_fmt(want_a[ix])}, got {_fmt(got_a[ix])}"
                      for ix in first)
    err = np.nanmax(np.abs(g - w)[bad]) if n else 0.0
    tol = f"rtol={rtol:g}, atol={atol:g}" if (rtol or atol) else "exact"
    raise AssertionError(head + f"{n} of {bad.size} elements differ ({tol}; shape {want_a.shape}, "
                                f"dtype {got_a.dtype}); first: {shown}; max abs error {err:.3g}")


def _snapshot(v):
    """A copy of what v holds: arrays (an ndarray, a Tensor's ``.data``) and plain values, also
    inside lists/tuples/dicts; None for anything else (a comm, a store, a function)."""
    if isinstance(v, np.ndarray):
        return v.copy()
    if isinstance(getattr(v, "data", None), np.ndarray):
        return ("tensor", v.data.copy())
    if isinstance(v, (int, float, complex, str, bytes, np.generic)) or v is None:
        return ("val", v)
    if isinstance(v, (list, tuple)):
        return ("seq", list(v), [_snapshot(x) for x in v])
    if isinstance(v, dict):
        return ("dict", dict(v), {k: _snapshot(x) for k, x in v.items()})
    return None


def _first_change(now, was, path: str):
    """(path, index, was, now) of the first part of ``now`` that differs from snapshot ``was``."""
    if was is None:
        return None
    if isinstance(was, np.ndarray):
        now = np.asarray(now)
        if now.shape != was.shape or now.dtype != was.dtype:
            return path, None, f"{was.shape} {was.dtype}", f"{now.shape} {now.dtype}"
        diff = ~((now == was) | (np.isnan(now) & np.isnan(was))) if now.dtype.kind in "fc" else now != was
        if diff.any():
            ix = tuple(int(i) for i in np.argwhere(diff)[0])
            return path, ix, _fmt(was[ix]), _fmt(now[ix])
        return None
    kind, old, inner = (*was, None) if len(was) == 2 else was
    if kind == "val":
        same = now is old or (type(now) is type(old) and (now == old or (now != now and old != old)))
        return None if same else (path, None, repr(old), repr(now))
    if kind == "tensor":
        return _first_change(now.data, old, path + ".data")
    if kind == "seq" and len(now) != len(old) or kind == "dict" and now.keys() != old.keys():
        return path, None, repr(old), repr(now)
    for k, w in (inner.items() if kind == "dict" else enumerate(inner)):
        if w is None and now[k] is not old[k]:
            return f"{path}[{k!r}]", None, repr(old[k]), repr(now[k])
        found = _first_change(now[k], w, f"{path}[{k!r}]")
        if found:
            return found
    return None


def untouched(fn, names=None, writes=()):
    """``fn`` wrapped so that a call which changes any array it was given (an ndarray, a Tensor's
    data, or one inside a list/tuple/dict argument) raises an AssertionError naming the argument and
    its first changed element: the caller still owns its inputs, and a function that writes into
    them (``x += ...``, ``np.array_split`` views, ``out=x``) corrupts the caller's next use. ``names``:
    the spec's argument names by position (default: ``fn``'s own parameter names); ``writes``: the
    names of those the spec says the function updates in place (a cache, a free list): not checked."""
    import functools
    import inspect

    if names is None:
        try:
            names = [q.name for q in inspect.signature(fn).parameters.values()]
        except (TypeError, ValueError):
            names = []
    task = getattr(fn, "__name__", "the function")

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        labelled = [(names[i] if i < len(names) else f"argument {i + 1}", a) for i, a in enumerate(args)]
        labelled += list(kwargs.items())
        before = [(n, a, _snapshot(a)) for n, a in labelled if n not in writes]
        out = fn(*args, **kwargs)
        for n, a, was in before:
            found = _first_change(a, was, n)
            if found:
                path, ix, old, new = found
                at = "" if ix is None else f"[{', '.join(map(str, ix))}]"
                raise AssertionError(f"{task} changed its input {path}: {path}{at} was {old}, is now {new}; "
                                     f"the caller still owns its arguments: work on a copy "
                                     f"(x.copy(), list(xs), dict(d)), or write x = x + ... not x += ...")
        return out
    return wrapped


def grader_tests(name: str, checks: dict, reference, broken: dict):
    """The three pytest tests every grader runs in CI: minidist's own ``reference()`` passes every
    check, each deliberately ``broken`` version fails its task's check, and the untouched stub in
    exercises/NAME.py scores 0, reported as "not written yet". Assign them to ``test_*`` names."""
    import types

    import pytest  # only CI calls this: graders themselves never import pytest

    @pytest.mark.parametrize("task", list(checks))
    def test_reference_passes(task):
        checks[task](reference())

    @pytest.mark.parametrize("task,wrong", [(t, b) for t, bs in broken.items() for b in bs],
                             ids=lambda v: getattr(v, "__name__", v))
    def test_broken_implementation_fails(task, wrong):
        with pytest.raises(AssertionError) as failure:
            checks[task](types.SimpleNamespace(**{task: wrong}))
        message = str(failure.value).strip()
        assert len(message) >= 20, f"a failure must say what is wrong, not {message!r}"

    def test_grade_reports_the_stub_as_not_written(capsys):
        assert grade(name) == (0, len(checks))
        assert capsys.readouterr().out.count("not written yet") == len(checks)

    return test_reference_passes, test_broken_implementation_fails, test_grade_reports_the_stub_as_not_written
