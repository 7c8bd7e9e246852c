"""Lesson 4 --overlap on the virtual clock: collective matmul against the unfused layer as the link
slows, with the crossover h* = (p·c - C)/(p-1) worked by hand on the H100's roofline.

The layer: x 4x256x512 float32 on tp = 2 (a shard of 4x128x512 = 1 MiB), 2048 output features
(1024 a rank: w is 512x1024 = 2 MiB, y 4x256x1024 = 4 MiB). On an H100 (3350 GB/s, 791 TFLOP/s at
80% of peak) every GEMM here is memory-bound:

    C  = (x 2 + w 2 + y 4 MiB) / 3350 GB/s        = 2.504 us   (the all-gather is the link's)
    c  = (x 1 + w 2 + y 2 MiB) / 3350 GB/s        = 1.565 us   a chunk: half the rows, all of w
    h* = (2c - C) / 1 = w / 3350 GB/s             = 0.626 us   = reading the weight shard once more
    beta* = S / h* = 1 MiB / 0.626 us              = 1675 GB/s
"""

import re

import pytest

from minidist.comm import run
from minidist.comm.transports import link as link_module
from minidist.comm.transports.link import parse_link
from minidist.lessons.tensor_parallel_overlap import cm_crossover

MIB, HBM = 2**20, 3350e9


@pytest.fixture
def h100(monkeypatch):
    monkeypatch.setenv("MINIDIST_CLOCK", "virtual")
    monkeypatch.setenv("MINIDIST_DEVICE", "tflops=791.2,gBps=3350,overhead_us=0,name=H100")
    monkeypatch.setattr(link_module, "_CURRENT", [])


def _number(pattern, out):
    return float(re.search(pattern, out).group(1).replace(",", ""))


def test_collective_matmul_wins_from_the_hand_worked_crossover(h100, capsys):
    nvlink = parse_link("alpha_us=5,gBps=450")
    verdicts = run(lambda comm: cm_crossover(comm, nvlink), ranks=2)
    out = capsys.readouterr().out
    assert verdicts == [True, True] and "FAIL" not in out, out
    assert _number(r"C = ([\d.]+) us", out) == pytest.approx(8 * MIB / HBM * 1e6, abs=0.006)
    assert _number(r"p·c = ([\d.]+) us", out) == pytest.approx(2 * 5 * MIB / HBM * 1e6, abs=0.006)
    h_star = _number(r"h\* = \(p·c - C\)/\(p-1\) = ([\d.]+) us", out)
    assert h_star == pytest.approx(2 * MIB / HBM * 1e6, abs=1e-3)
    assert _number(r"slower than S/h\* = ([\d,]+) GB/s", out) == pytest.approx(1675, abs=1)
    assert _number(r"the clock's lines cross at h = ([\d.]+) us", out) == pytest.approx(0.626, abs=2e-3)
    faster = re.findall(r"^\s+[\d.]+\s+([\d.]+)\s.*  (cm|unfused)$", out, re.M)
    assert faster and all((w == "cm") == (float(h) > 0.6262) for h, w in faster), faster
    # NVLink: a hop of 5 us + 1 MiB / 450 GB/s = 7.33 us outlasts a chunk: c/h = 1.565/7.33 hidden
    assert _number(r"a hop takes ([\d.]+) us", out) == pytest.approx(5 + MIB / 450e9 * 1e6, abs=0.01)
    c_over_h = 5 * MIB / HBM / (5e-6 + MIB / 450e9)
    assert _number(r"the trace shows (\d+)% of the hops' time", out) == round(100 * c_over_h)  # 21%
