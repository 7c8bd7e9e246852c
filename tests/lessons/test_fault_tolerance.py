"""Lesson 10 under the supervisor: it says the MPICH banner is the injected kill, says which attempt
resumed from which step, and its ``--trace`` holds both attempts of the restarted job.

The expected steps come from the fault spec and the save interval, not from the lesson: with
synchronous saves to memory every ``MEM_EVERY`` steps and ``kill:...,step=KILL`` (the rank kills
itself when KILL steps are done), attempt 0 completes steps 1..KILL, the newest checkpoint is of step
KILL // MEM_EVERY * MEM_EVERY, and attempt 1's first step is that step + 1.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS, MEM_EVERY, KILL, RANKS = 6, 2, 3, 2


def supervised_lesson(tmp_path, *, threads=True, timeout=120):
    """Run the lesson under ``python -m minidist.launch`` with a kill of rank 1; the completed process."""
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "minidist.launch", "-n", str(RANKS), "--ckpt", str(ckpt),
           *(["--threads"] if threads else []), "--",
           sys.executable, "-m", "minidist.lessons.fault_tolerance",
           "--steps", str(STEPS), "--mem-every", str(MEM_EVERY), "--disk-every", "0", "--sync",
           "--fault", f"kill:rank=1,step={KILL}", "--ckpt", str(ckpt), "--mem-dir", str(tmp_path / "mem"),
           "--trace", str(tmp_path / "trace.json")]
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("MINIDIST_TRANSPORT", None)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)


def check_run(tmp_path, res):
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    checkpointed = KILL // MEM_EVERY * MEM_EVERY
    # the dying rank's warning comes before the supervisor sees the failure (stdout keeps the order)
    warn = res.stdout.index("rank 1: injecting kill:rank=1,step=3 now. Under mpirun, the 'BAD "
                            "TERMINATION' banner MPICH prints next is this injected kill, and expected")
    assert warn < res.stdout.index("attempt 0 FAILED"), res.stdout
    assert "injected kill:rank=1,step=3 -> SIGKILL" in res.stderr
    assert f"attempt 1 resumed from its tier memory checkpoint of step {checkpointed}: its first step is " \
           f"step {checkpointed + 1}" in res.stdout

    chrome = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in chrome if e["name"] == "process_name"}
    assert names == {0: "attempt 0", 1: "attempt 1"}
    for rank in range(RANKS):  # every rank of each attempt is in the trace, with its steps
        steps = {pid: sorted({e["args"]["step"] for e in chrome if e["name"].startswith("step ")
                              and e["pid"] == pid and e["tid"] == rank}) for pid in (0, 1)}
        # the killed rank flushed step KILL before it died; a peer may be killed with it between
        # finishing step KILL and writing it down
        done = (KILL,) if rank == 1 else (KILL - 1, KILL)
        assert steps[0] in [list(range(1, k + 1)) for k in done], (rank, steps)
        assert steps[1] == list(range(checkpointed + 1, STEPS + 1)), (rank, steps)
    # attempt 1 starts after attempt 0 ended, on the one time axis of the merged trace
    end0 = max(e["ts"] + e["dur"] for e in chrome if e.get("ph") == "X" and e["pid"] == 0)
    start1 = min(e["ts"] for e in chrome if e.get("ph") == "X" and e["pid"] == 1)
    assert end0 < start1
    assert not (tmp_path / "trace.json.parts").exists()  # the parts are merged, then removed


def test_trace_holds_both_attempts_threads(tmp_path):
    check_run(tmp_path, supervised_lesson(tmp_path))


@pytest.mark.mpi
@pytest.mark.slow
def test_trace_holds_both_attempts_mpirun(tmp_path):
    check_run(tmp_path, supervised_lesson(tmp_path, threads=False))
