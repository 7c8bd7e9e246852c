"""The pipeline lesson's report: the planner's bubble for this machine beside the textbook formula."""

import os
import re

import pytest

from minidist.lessons import pipeline

ARGV = "--dp 1 --steps 1 --width 16 --seq 8 --layers 2 --batch 8 --microbatches 4"


@pytest.mark.parametrize("ranks, schedule, work", [(4, "1f1b", 1), (2, "zb-h1", 3)])
def test_the_planners_bubble_for_this_machine_is_the_shared_cores_formula(capsys, ranks, schedule, work):
    """p ranks on this machine's cores, s = max(1, ranks / cores): each rank's work runs s times slower
    and its waits do not, so 1F1B's (p-1)/(m+p-1) becomes (p-1)/(s·m + p-1); ZB-H1's (p-1)/(3m+p-1)
    with F = B = W becomes (p-1)/(3·s·m + p-1)."""
    assert all(pipeline.main(["--ranks", str(ranks), "--schedule", schedule, *ARGV.split()]))  # all PASS
    out = capsys.readouterr().out
    got = re.search(r"planner's bubble for this machine: ([0-9.]+) ", out)
    assert got, out
    p, m = ranks, 4
    s = max(1.0, ranks / (os.cpu_count() or 1))
    assert float(got.group(1)) == pytest.approx((p - 1) / (work * s * m + p - 1), abs=5e-4)
    assert f"s = ranks/cores = {ranks}/{os.cpu_count()}" in out
