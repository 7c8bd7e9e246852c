"""The pipeline lesson's report: the planner's bubble for this machine beside the textbook formula,
and the measured split of the ranks' time it is to be held against."""

import os
import re

import pytest

from minidist.lessons import pipeline

ARGV = "--dp 1 --steps 1 --width 16 --seq 8 --layers 2 --batch 8 --microbatches 4"


@pytest.mark.parametrize("ranks, schedule, work", [(4, "1f1b", 1), (2, "zb-h1", 3)])
def test_the_planners_bubble_for_this_machine_and_the_measured_split(capsys, ranks, schedule, work):
    """On a core per rank the planner's bubble is the paper's: 1F1B (p-1)/(m+p-1), ZB-H1 with
    F = B = W (p-1)/(3m+p-1). On fewer cores it is a share in [0, 1); the measured split of the ranks'
    time into forward/backward, receiving and the rest adds up to 1."""
    assert all(pipeline.main(["--ranks", str(ranks), "--schedule", schedule, *ARGV.split()]))  # all PASS
    out = capsys.readouterr().out
    got = re.search(r"planner's bubble for this machine: ([0-9.]+) \((\d+) ranks on (\d+) cores", out)
    assert got, out
    value, p, m = float(got.group(1)), ranks, 4
    assert int(got.group(2)) == ranks and int(got.group(3)) == (os.cpu_count() or 1)
    if ranks <= (os.cpu_count() or 1):
        assert value == pytest.approx((p - 1) / (work * m + p - 1), abs=5e-4)
    else:
        assert 0.0 <= value < 1.0
    split = re.search(r"forward/backward ([0-9.]+), waiting to receive ([0-9.]+), all-reduce/optimizer/sends "
                      r"([0-9.]+)", out)
    assert split, out
    parts = [float(x) for x in split.groups()]
    assert sum(parts) == pytest.approx(1.0, abs=2e-3) and parts[0] > 0
