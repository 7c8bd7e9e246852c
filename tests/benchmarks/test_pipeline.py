"""benchmarks/pipeline.py --quick: the table comes out whole (a smoke run, thread ranks, a tiny GPT)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow  # ~5 s: a subprocess, imports, 4 schedules trained
def test_quick_run_prints_every_runnable_schedule_against_its_formula():
    env = dict(os.environ, PYTHONPATH=ROOT, OPENBLAS_NUM_THREADS="1")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "pipeline.py"), "--quick"],
                         capture_output=True, text=True, env=env, timeout=120, check=True).stdout
    assert "cpu: " in out and "load average" in out
    assert "p = 2, m = 4: F/B/W ms per stage" in out
    cut = next(line for line in out.splitlines() if line.startswith("cut by measured layer costs"))
    assert "1f1b 0-1 2-3" in cut and "zb_v 0-0 1-1 2-2 3-3" in cut  # 4 layers: one cut a placement
    for name in ("1f1b", "gpipe", "zb_h1"):
        rows = [line for line in out.splitlines() if line.startswith(name + " ")]
        assert len(rows) == 1 and rows[0].count("MET") + rows[0].count("MISSED") == 3, rows
    assert "p = 8, simulated" in out
