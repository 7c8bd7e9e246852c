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


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-h2"])
def test_the_zero_bubble_memory_table_prints_m_b_and_m_w_apart(capsys, schedule):
    """p = 4, m = 8 on threads: each stage's measured microbatches from F to B (M_B) and from B to W
    (M_W) beside the schedule's simulated ones. ZB-H1 by hand: M_B = p - s, M_W = s + 1 (its order
    puts off s W's); ZB-H2: M_B = 2(p-s) - 1. The bytes: M_B's at most 1F1B's, M_W's counted apart."""
    argv = "--dp 1 --steps 1 --width 16 --seq 8 --layers 2 --batch 8 --microbatches 8"
    assert all(pipeline.main(["--ranks", "4", "--schedule", schedule, *argv.split()]))
    out = capsys.readouterr().out
    row = r"^\s+(\d) +([\d,]+) +(\d+)   +([\d,]+) +(\d+) +(\d+)   +([\d,]+) +(\d+) +(\d+)$"
    rows = re.findall(row, out, re.M)
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3], out
    for s, ob, om, zb, zm, zsim, wb, wm, wsim in rows:
        s = int(s)
        want_b = 4 - s if schedule == "zb-h1" else 2 * (4 - s) - 1
        assert int(zm) == int(zsim) == want_b and int(om) == 4 - s
        if schedule == "zb-h1":
            assert int(wm) == int(wsim) == s + 1
            assert int(zb.replace(",", "")) == int(ob.replace(",", ""))  # 1F1B's M_B, byte for byte
        assert int(wb.replace(",", "")) > 0
