"""Lesson 2 on the virtual clock: the alpha-beta model's times, worked by hand, against the real
tree, ring and halving-doubling code; the tree/ring crossover; the ring as p grows to 64.

The clock charges each message alpha + bytes/beta and, under a device model, nothing for the sums,
so the times are exact and load cannot move them: these tests need no ``timing`` marker."""

import re

import numpy as np
import pytest

from minidist.comm import all_reduce, run
from minidist.lessons import allreduce as lesson
from minidist.lessons import allreduce_model as am

ALPHA, BW = 30e-6, 1.25e9                       # --link ethernet: 30 us, 1.25 GB/s
H100 = "tflops=791.2,gBps=3350,overhead_us=0,name=H100"


@pytest.fixture
def virtual(monkeypatch):
    """The virtual clock on ethernet with compute on a device (every key restored afterwards, also
    those a lesson's main() sets)."""
    from minidist.comm.transports import link

    monkeypatch.setenv("MINIDIST_CLOCK", "virtual")
    monkeypatch.setenv("MINIDIST_LINK", "alpha_us=30,gBps=1.25")
    monkeypatch.setenv("MINIDIST_DEVICE", H100)
    monkeypatch.setattr(link, "_CURRENT", [])


def test_the_model_is_the_hand_worked_alpha_beta_time():
    # p = 4, N = 4096 B: N/beta = 3.2768 us; L = 2
    assert am.model("tree", 4, 4096, ALPHA, BW) == pytest.approx(4 * 30e-6 + 4 * 3.2768e-6)      # 133.1 us
    assert am.model("ring", 4, 4096, ALPHA, BW) == pytest.approx(6 * 30e-6 + 1.5 * 3.2768e-6)    # 184.9 us
    assert am.model("halving_doubling", 4, 4096, ALPHA, BW) == pytest.approx(4 * 30e-6 + 1.5 * 3.2768e-6)
    # tree = ring where 2L·a + 2L·N/b = 2(p-1)·a + 2(p-1)/p·N/b; alpha·beta = 37,500 B
    assert am.crossover("tree", "ring", 4, ALPHA, BW) == pytest.approx(0.8 * 37_500)  # (3-2)/(2-3/4)
    assert am.crossover("tree", "ring", 8, ALPHA, BW) == pytest.approx(37_500 * 4 / 2.125)       # 70,588 B
    assert am.crossover("tree", "ring", 64, ALPHA, BW) == pytest.approx(37_500 * 57 / (6 - 63 / 64))
    assert am.crossover("tree", "ring", 2, ALPHA, BW) is None        # same rounds, the ring half the bytes
    assert am.crossover("halving_doubling", "ring", 8, ALPHA, BW) is None     # same bytes, fewer rounds
    assert am.crossover("halving_doubling", "tree", 8, ALPHA, BW) is None     # same rounds, fewer bytes
    with pytest.raises(ValueError, match="power of two"):
        am.model("tree", 6, 4096, ALPHA, BW)


def test_measured_crossover_is_where_the_lines_cross_between_two_sizes():
    sizes = [1.0, 4.0, 16.0]
    a, b = [1 + 2 * n for n in sizes], [3 + n for n in sizes]            # equal at n = 2
    assert am.measured_crossover(sizes, a, b) == pytest.approx(2.0)
    assert am.measured_crossover([2.0, 4.0], [5.0, 9.0], [5.0, 7.0]) == 2.0   # equal at a measured size
    assert am.measured_crossover(sizes, b, [x + 10 for x in b]) is None      # never cross


def _hand(algorithm, p, nbytes):
    """The textbook times, written out again here (not the lesson's model)."""
    L, n = p.bit_length() - 1, nbytes / BW
    return {"tree": 2 * L * (ALPHA + n), "ring": 2 * (p - 1) * ALPHA + 2 * (p - 1) / p * n,
            "halving_doubling": 2 * L * ALPHA + 2 * (p - 1) / p * n}[algorithm]


@pytest.mark.parametrize("p", [2, 4, 8, 16])
def test_the_algorithms_take_the_textbook_time_on_the_virtual_clock(virtual, p):
    sizes = [4 * p, 4 * p * 256, 4 * p * 4096]              # whole float32 chunks: 1 element to 16K each

    def body(comm):
        return [{a: am.virtual_seconds(comm, lambda a=a, n=n: all_reduce(comm, np.ones(n // 4, np.float32),
                                                                         algorithm=a))
                 for a in am.ALGORITHMS} for n in sizes]

    got = run(body, ranks=p)[0]
    for n, times in zip(sizes, got):
        for a, t in times.items():
            assert t == pytest.approx(_hand(a, p, n), rel=1e-9), (a, p, n)


def _lesson(capsys, ranks):
    lesson.main(["--ranks", str(ranks), "--clock", "virtual", "--link", "ethernet", "--elements", "64",
                 "--repeats", "1"])
    return capsys.readouterr().out


def test_the_lesson_finds_the_crossover_and_the_ring_grows_as_the_formula(virtual, capsys):
    out = _lesson(capsys, 8)
    assert "FAIL" not in out and "compute on H100" in out
    seen = re.search(r"the clock's times cross at ([\d.]+) KB \(between 64 KB and 128 KB\)  PASS", out)
    assert seen and float(seen.group(1)) == pytest.approx(37_500 * 4 / 2.125 / 1024, abs=0.05), out
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
    assert [int(r[0]) for r in rows] == [2, 4, 8]
    for p, latency, transfer, formula, clock, ratio in rows:
        p, n = int(p), lesson.SCALING_BYTES
        assert float(latency) == pytest.approx(2 * (p - 1) * 30, abs=0.05)            # us
        assert float(transfer) == pytest.approx(2 * (p - 1) / p * n / BW * 1e6, abs=0.05)
        assert float(clock) == pytest.approx(float(formula), abs=0.05) and ratio == "1.000"
    for line in (x for x in out.splitlines() if x.strip().startswith(("2 KB", "64 KB", "1 MB"))):
        cells = re.findall(r"([\d.]+) / ([\d.]+)", line)
        assert len(cells) == 3 and all(a == b for a, b in cells), line     # model == clock, each algorithm


def test_at_p_2_the_tree_never_beats_the_ring_and_p_6_asks_for_a_power_of_two(virtual, capsys):
    assert "tree vs ring: no crossover at p = 2" in _lesson(capsys, 2)
    out = _lesson(capsys, 6)
    assert "the crossover table needs p a power of two; p = 6 is not: try --ranks 4" in out
    assert "FAIL" not in out


@pytest.mark.slow  # 64 thread ranks: ~20 s on 2 cores
def test_64_ranks_on_threads_show_the_ring_growing_as_the_formula(virtual, capsys):
    out = _lesson(capsys, 64)
    rows = re.findall(r"^\s+(\d+)\s+[\d.]+\s+[\d.]+\s+([\d.]+)\s+([\d.]+)\s+1\.000$", out, re.M)
    assert [int(p) for p, *_ in rows] == [2, 4, 8, 16, 32, 64] and "FAIL" not in out
    assert float(rows[-1][1]) == pytest.approx((126 * 30e-6 + 126 / 64 * 2**20 / BW) * 1e6, abs=0.05)
