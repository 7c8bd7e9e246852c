"""The planning lesson on the virtual clock: the planner's step beside the emulated cluster's.

Two thread ranks of a GPT with 8,768 parameters (vocab 64, context 8, 2 blocks, width 16: the
planner picks dp2), an H100 device model and NVLink (5 us + bytes / 450 GB/s). The data-parallel
all-reduce of the gradients (N = 4 x 8,768 = 35,072 bytes, one bucket) is a ring on 2 ranks: 2
rounds of alpha + (N/2)/beta, by hand 2 x (5 us + 17,536 B / 450 GB/s) = 10.0779 us -- all of the
step that is not compute (the update's ops are not priced on the device model). The compute is the
ops' roofline, a tenth of a microsecond here.
"""

import re

import pytest

from minidist.lessons import planning
from minidist.nn import GPT, GPTConfig

ARGS = ["--ranks", "2", "--steps", "3", "--batch", "4", "--seq", "8", "--layers", "2", "--width", "16"]
ALPHA, BETA = 5e-6, 450e9


@pytest.fixture
def virtual(monkeypatch):
    for name in ("MINIDIST_CLOCK", "MINIDIST_LINK", "MINIDIST_DEVICE"):
        monkeypatch.delenv(name, raising=False)  # use_clock sets them: gone again after the test
    from minidist.comm.transports import link

    monkeypatch.setattr(link, "_CURRENT", [])


def test_predicted_and_emulated_step_agree_and_the_link_part_is_the_hand_worked_ring(virtual, capsys):
    results = planning.main(ARGS + ["--clock", "virtual", "--link", "nvlink", "--device", "h100"])
    out = capsys.readouterr().out
    assert all(results), out
    assert "training the planner's best: dp2 tp1 pp1" in out
    n = 4 * sum(p.data.size for p in GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=4,
                                                  d_model=16)).parameters())
    assert n == 35_072
    ring = 2 * (ALPHA + n / 2 / BETA)
    assert ring == pytest.approx(10.0779e-6, abs=1e-10)
    step = re.search(r"step time: predicted ([\d.]+) us, emulated \(H100-SXM5-80GB on the virtual clock\) "
                     r"([\d.]+) us, ratio ([\d.]+): within 10% (PASS|FAIL)", out)
    assert step, out
    predicted, emulated, ratio = (float(x) for x in step.groups()[:3])
    assert step.group(4) == "PASS" and ratio == pytest.approx(predicted / emulated, abs=2e-3)
    rest = re.search(r"the rest \(messages, waits, update\): planner ([\d.]+) us, emulated ([\d.]+) us", out)
    assert float(rest.group(2)) == pytest.approx(ring * 1e6, abs=0.006)  # the clock: the ring, exactly
    compute = re.search(r"the clock's roofline op by op ([\d.]+) us", out)
    assert 0 < float(compute.group(1)) < 1 and emulated == pytest.approx(ring * 1e6 + float(compute.group(1)),
                                                                        abs=0.011)


def test_a_device_model_needs_the_virtual_clock(virtual):
    with pytest.raises(SystemExit, match="add --clock virtual"):
        planning.main(ARGS + ["--device", "h100"])
