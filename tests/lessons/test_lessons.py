"""Exit codes tell the truth: a lesson whose check prints FAIL exits nonzero, on threads and under
mpirun; every rank agrees on rank 0's verdict; a misconfigured transport is an error, not a PASS."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from minidist.comm import run
from minidist.lessons import cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {k: v for k, v in os.environ.items() if k != "MINIDIST_TRANSPORT"} | {"PYTHONPATH": ROOT}

# the all-reduce lesson with its ring all-reduce broken (one rank's input counted twice) when argv[1]
# is "broken": the lesson's own check must catch it, print FAIL and exit 1
ALLREDUCE = textwrap.dedent("""
    import sys
    from minidist.lessons import allreduce as lesson
    if sys.argv[1] == "broken":
        good = lesson.ring_all_reduce
        lesson.ring_all_reduce = lambda comm, x: good(comm, x) + x
    lesson.main(["--ranks", "2", "--elements", "64", "--repeats", "1"])
""")


def python(*args, launcher=(), env=ENV, timeout=120):
    return subprocess.run([*launcher, sys.executable, *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


def test_finish_is_rank_zeros_verdict_on_every_rank():
    assert run(lambda comm: cli.finish(comm, comm.rank != 0), ranks=3) == [False] * 3
    assert run(lambda comm: cli.finish(comm, comm.rank == 0), ranks=3) == [True] * 3


def test_launch_exits_1_when_a_rank_reports_failure(capsys):
    class Args:
        ranks = 2

    with pytest.raises(SystemExit) as info:
        cli.launch(lambda comm, args: cli.finish(comm, False), Args())
    assert info.value.code == 1
    assert "FAIL" in capsys.readouterr().err
    assert cli.launch(lambda comm, args: cli.finish(comm, True), Args()) == [True, True]
    assert cli.launch(lambda comm, args: comm.rank, Args()) == [0, 1]  # other results pass through


def test_a_failing_check_exits_nonzero_on_threads():
    good = python("-c", ALLREDUCE, "ok")
    assert good.returncode == 0, good.stderr
    assert good.stdout.count("PASS") == 5 and "FAIL" not in good.stdout
    bad = python("-c", ALLREDUCE, "broken")
    assert bad.returncode == 1, bad.stderr
    ring = next(line for line in bad.stdout.splitlines() if line.startswith("ring"))
    assert "FAIL" in ring and bad.stdout.count("PASS") == 4
    assert "exit status 1" in bad.stderr


def test_a_tolerance_no_run_can_meet_fails_in_process(capsys):
    """tp=2 sums partial products in another order than the serial twin: a 1e-30 tolerance FAILs."""
    from minidist.lessons import tensor_parallel

    with pytest.raises(SystemExit) as info:
        tensor_parallel.main(["--ranks", "2", "--steps", "1", "--seq", "8", "--d-model", "16",
                              "--layers", "1", "--tol", "1e-30"])
    assert info.value.code == 1
    assert "FAIL" in capsys.readouterr().out


def test_data_parallel_with_one_row_on_the_smallest_rank_passes(capsys):
    """The boundary of the zero-row check: --batch 4 on 4 ranks gives every rank a row, and runs."""
    from minidist.lessons import data_parallel

    data_parallel.main(["--ranks", "4", "--batch", "4", "--steps", "1", "--accum", "2", "--seq", "8",
                        "--d-model", "16", "--layers", "1", "--overlap-d-model", "16",
                        "--overlap-layers", "1", "--overlap-rows", "2"])
    out = capsys.readouterr().out
    assert "split unevenly [1, 1, 1, 1]" in out and "PASS" in out and "FAIL" not in out


def test_mpi_transport_outside_mpirun_is_an_error_not_a_pass():
    r = python("-m", "minidist.lessons.allreduce", "--elements", "8", "--repeats", "1",
               env=ENV | {"MINIDIST_TRANSPORT": "mpi"})
    assert r.returncode != 0
    assert "PASS" not in r.stdout
    assert "MINIDIST_TRANSPORT=mpi" in r.stderr and "mpirun -n N" in r.stderr


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun (pip install mpich)")
def test_a_failing_check_exits_nonzero_under_mpirun():
    bad = python("-c", ALLREDUCE, "broken", launcher=("mpirun", "-n", "2"))
    assert bad.returncode != 0, bad.stdout + bad.stderr
    assert "FAIL" in bad.stdout
    good = python("-c", ALLREDUCE, "ok", launcher=("mpirun", "-n", "2"))
    assert good.returncode == 0, good.stdout + good.stderr
    assert "FAIL" not in good.stdout and "PASS" in good.stdout


def _skewed(fn, scale=1.1):
    """``fn`` whose returned (state, losses) or losses are off by 10% (more than any lesson's
    tolerance): a serial twin gone wrong."""
    def wrapped(*a, **k):
        out = fn(*a, **k)
        if isinstance(out, tuple):
            state, losses = out
            return {n: v * scale for n, v in state.items()}, [x * scale for x in losses]
        return [x * scale for x in out]
    return wrapped


class _FastAdamW:
    """AdamW with twice the learning rate, as the offload lesson's in-memory twin."""

    def __new__(cls, params, lr, **kw):
        from minidist.nn.optim import AdamW

        return AdamW(params, lr=2 * lr, **kw)


TWINS = {  # lesson -> (attribute to break, breaker, small argv)
    "data_parallel": ("serial_twin", _skewed, "--ranks 2 --steps 1 --seq 8 --d-model 16 --layers 1 "
                      "--overlap-d-model 16 --overlap-layers 1 --overlap-rows 2"),
    "mixed_precision": ("serial_fp32", _skewed, "--ranks 2 --dim 16 --seq 8 --layers 1"),
    "pipeline": ("train_serial", _skewed, "--ranks 2 --dp 1 --steps 1 --width 16 --seq 8 --layers 1 "
                 "--microbatches 2 --batch 4"),
    "offload": ("AdamW", lambda _: _FastAdamW, "--ranks 2 --dim 16 --seq 8 --steps 2"),
}


@pytest.mark.parametrize("name", sorted(TWINS))
def test_each_lesson_exits_1_when_its_serial_twin_disagrees(name, monkeypatch, capsys, tmp_path):
    import importlib

    lesson = importlib.import_module(f"minidist.lessons.{name}")
    attr, breaker, argv = TWINS[name]
    monkeypatch.setattr(lesson, attr, breaker(getattr(lesson, attr)))
    with pytest.raises(SystemExit) as info:
        lesson.main(argv.split() + (["--offload-dir", str(tmp_path)] if name == "offload" else []))
    assert info.value.code == 1
    assert "FAIL" in capsys.readouterr().out


def test_every_launched_lesson_names_its_transport_backend_and_each_ranks_device(capsys):
    import jax

    from minidist.accel.backend import get_backend
    from minidist.comm.transports.devices import describe_binding
    from minidist.lessons import cli

    got = describe_binding(get_backend("jax"), 3, "threads")
    devices = jax.devices()  # 8 forced CPU devices in tests: rank r is bound to device r
    assert got == (f"3 ranks (threads), backend jax: rank 0 -> {devices[0]}, rank 1 -> {devices[1]}, "
                   f"rank 2 -> {devices[2]}")
    args = cli.lesson_parser("probe", ranks=2).parse_args(["--ranks", "2"])
    cli.launch(lambda comm, a: True, args)
    assert capsys.readouterr().out.splitlines()[0] == "2 ranks (threads), backend numpy on the host CPU"


# run_lesson's end of a process, with JAX loaded (no teardown: os._exit, which says "fast") and
# without: the status, the output and what other threads and exit handlers still had to do all
# come through; a thread pool left running does not hang the exit
RUN_LESSON = textwrap.dedent("""
    import atexit, os, sys, threading, time
    if sys.argv[1] == "jax":
        import jax
    from minidist.lessons.cli import run_lesson
    real_exit = os._exit
    os._exit = lambda code: (sys.stderr.write("fast\\n"), sys.stderr.flush(), real_exit(code))

    def main():
        atexit.register(lambda: print("exit handler ran"))
        if sys.argv[4] == "thread":
            def write():
                time.sleep(0.3)
                open(sys.argv[3], "w").write("whole")
            threading.Thread(target=write).start()
        if sys.argv[4] == "pool":
            from concurrent.futures import ThreadPoolExecutor
            global POOL  # kept, never shut down: its idle worker waits for the interpreter's word
            POOL = ThreadPoolExecutor(1)
            POOL.submit(lambda: open(sys.argv[3], "w").write("whole")).result()
        sys.stdout.write("x" * 200000 + "\\nlast line\\n")  # buffered: flushed by run_lesson
        if sys.argv[2] == "return":
            return 3
        if sys.argv[2] == "message":
            sys.exit("a message")
        raise SystemExit(0)

    run_lesson(main)
""")


@pytest.mark.parametrize("with_jax", ["jax", "numpy"])
@pytest.mark.parametrize("how, status", [("return", 3), ("message", 1), ("exit0", 0)])
@pytest.mark.parametrize("threads", ["none", "thread", "pool"])
def test_run_lesson_ends_with_mains_status_and_loses_nothing(tmp_path, with_jax, how, status, threads):
    buffered = {k: v for k, v in ENV.items() if k != "PYTHONUNBUFFERED"}  # (what a flush must empty)
    out = python("-c", RUN_LESSON, with_jax, how, str(tmp_path / "f"), threads, env=buffered, timeout=60)
    assert out.returncode == status, out.stderr[-2000:]
    assert out.stdout.endswith("x" * 200000 + "\nlast line\nexit handler ran\n")
    assert ("a message" in out.stderr) == (how == "message")
    if threads != "none":
        assert (tmp_path / "f").read_text() == "whole"  # the other thread finished first
    # the fast exit only with JAX loaded and no other thread left to wait for
    assert ("fast" in out.stderr.split()) == (with_jax == "jax" and threads == "none")


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
def test_run_lesson_under_mpirun_with_jax_keeps_a_failing_ranks_status():
    """Rank 1 fails after rank 0 has finished: the job's status is 1. With JAX's fast exit under MPI
    (os._exit skips mpi4py's finalize) rank 0 left first and the job ended 0, rank 1's FAIL lost."""
    code = textwrap.dedent("""
        import sys, time
        import jax
        from mpi4py import MPI
        from minidist.lessons.cli import run_lesson

        def main():
            MPI.COMM_WORLD.Barrier()
            if MPI.COMM_WORLD.Get_rank() == 1:
                time.sleep(1.0)
                print("rank 1: FAIL", flush=True)
                return 1
            return 0

        run_lesson(main)
    """)
    out = python("-c", code, launcher=("mpirun", "-n", "2"), timeout=120)
    assert "rank 1: FAIL" in out.stdout, out.stdout + out.stderr[-2000:]
    assert out.returncode == 1, out.stderr[-2000:]
