"""run(), world(), tracing hooks, the lesson command line and the all-reduce lesson."""

import json

import numpy as np

from minidist.comm import all_reduce, measure, run, world
from minidist.lessons import allreduce as lesson


def test_run_returns_results_in_rank_order_and_sets_each_ranks_backend():
    from minidist.accel.backend import default_backend

    out = run(lambda comm, k: (comm.rank, comm.size, default_backend().name, k), ranks=3, k=7)
    assert out == [(r, 3, "numpy", 7) for r in range(3)]


def test_world_is_a_single_rank_outside_mpirun():
    comm = world()
    assert (comm.rank, comm.size) == (0, 1)
    np.testing.assert_array_equal(all_reduce(comm, np.arange(3)), np.arange(3))
    comm.barrier()


def test_collectives_and_messages_appear_as_trace_spans():
    from minidist import trace

    def body(comm):
        tracer = trace.Tracer(comm.rank)
        with trace.tracing(tracer):
            all_reduce(comm, np.ones(4), algorithm="ring")
            comm.sendrecv(np.ones(2), (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size)
        return [(e["name"], e["cat"]) for e in tracer.events]

    for events in run(body, ranks=2):
        assert ("ring_all_reduce", "collective") in events
        assert any(cat == "wait" for _, cat in events)


def test_barrier_and_async_under_debug_mode(monkeypatch):
    monkeypatch.setenv("MINIDIST_DEBUG", "1")
    from minidist.comm import all_reduce_async

    def body(comm):
        comm.barrier()
        with measure(comm) as m:
            h = all_reduce_async(comm, np.full(3, comm.rank, np.float64))
            y = h.wait()
        return y.tolist(), [c.name for c in m.calls]

    from minidist.comm.cost import choose_algorithm

    for y, calls in run(body, ranks=3):
        assert y == [3.0] * 3 and calls == [f"{choose_algorithm(24, 3)}_all_reduce"]


def test_lesson_runs_and_passes(capsys, tmp_path):
    trace_file = tmp_path / "t.json"
    lesson.main(["--ranks", "3", "--elements", "1001", "--repeats", "1", "--trace", str(trace_file)])
    out = capsys.readouterr().out
    assert out.count("PASS") == 5 and "FAIL" not in out  # naive, tree, ring, two-shot, halving-doubling
    assert "reduce-scatter" in out and "all-gather" in out
    for name in ("naive", "tree", "ring"):
        line = next(l for l in out.splitlines() if l.startswith(name))
        sent, formula = line.split()[3:5]
        assert sent == formula  # measured bytes == textbook formula
    plot_file = tmp_path / "allreduce.png"
    lesson.main(["--ranks", "4", "--elements", "1000", "--repeats", "1", "--plot", str(plot_file)])
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("halving"))
    assert line.split()[3] == line.split()[4] == f"{2 * 3 * 4000 // 4:,}"  # 2(p-1)/p N, p = 4
    assert f"wrote {plot_file}" in out
    assert plot_file.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot_file.stat().st_size > 10_000
    lesson.main(["--ranks", "1", "--elements", "10", "--repeats", "1"])
    rows = [l.split() for l in capsys.readouterr().out.splitlines()
            if l.split()[:1] and l.split()[0] in ("naive", "tree", "ring", "two-shot", "halving")]
    assert len(rows) == 5 and all(r[-3] == "0" for r in rows)  # one rank: no steps, for every algorithm
    events = json.loads(trace_file.read_text())["traceEvents"]
    assert {e.get("tid") for e in events if e.get("ph") == "X"} == {0, 1, 2}


# a rank that ends itself instead of returning: the run must not pass for a success
EARLY_EXIT = """
import os, sys
from minidist.comm import run

def body(comm):
    if comm.rank == 1:
        {exit}
    comm.barrier()
    return comm.rank

print("results", run(body, ranks=3))
"""


def _run_script(exit_call):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return subprocess.run([sys.executable, "-c", EARLY_EXIT.format(exit=exit_call)], capture_output=True,
                          text=True, timeout=120, cwd=root, env={**os.environ, "PYTHONPATH": root})


def test_a_thread_rank_calling_os_exit_0_fails_the_run_naming_it():
    out = _run_script("os._exit(0)")
    assert out.returncode == 1, (out.returncode, out.stdout, out.stderr)
    assert "results" not in out.stdout
    assert "RankExitedEarly: rank 1 of 3 called os._exit(0) before its function returned" in out.stderr


def test_sys_exit_0_in_a_rank_fails_and_a_nonzero_exit_keeps_its_status():
    out = _run_script("sys.exit(0)")
    assert out.returncode == 1 and "rank 1 of 3 called sys.exit(0)" in out.stderr, out.stderr
    out = _run_script("sys.exit(3)")
    assert out.returncode == 3 and "results" not in out.stdout, out.stderr


def test_early_exit_in_process_raises_and_leaves_os_exit_as_it_was():
    import os

    import pytest

    from minidist.comm.runner import RankExitedEarly

    real = os._exit

    def body(comm):
        if comm.rank == 0:
            os._exit(7)
        comm.barrier()

    for ranks in (1, 2):
        with pytest.raises(RankExitedEarly, match=f"rank 0 of {ranks} called os._exit\\(7\\)"):
            run(body, ranks=ranks)
    assert os._exit is real
    assert run(lambda comm: comm.rank, ranks=2) == [0, 1]  # ordinary runs are untouched
