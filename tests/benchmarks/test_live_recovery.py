"""benchmarks/live_recovery.py at small settings: both approaches' rows, the formula and the targets come
out whole; the steps redone are the formula's k - (k // c) c for the restart and 0 for live recovery."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow  # a subprocess that also times a second interpreter's start
def test_a_small_run_prints_both_approaches_and_the_targets():
    env = dict(os.environ, PYTHONPATH=ROOT, OPENBLAS_NUM_THREADS="1")
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "live_recovery.py"), "--steps", "12",
           "--kill", "7",
           "--every", "5", "--groups", "3", "--rows", "2", "--d-model", "16", "--layers", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=True).stdout
    assert "cpu: " in out and "load average" in out
    assert re.search(r"^steps of work redone\s+2\s+0$", out, re.M), out  # 7 - 5 = 2; live: 0
    assert re.search(r"^kill -> next finished step \(s\)\s+[\d.]+\s+[\d.]+$", out, re.M)
    assert re.search(r"each of the 3 groups reads the checkpoint of step 5", out)
    assert len(re.findall(r"^\s+\d+ h\s", out, re.M)) == 3   # the expected loss at 3 job MTBFs
    assert len(re.findall(r"  target .*(MET|MISSED)$", out, re.M)) == 5
