"""The planner's hardware helpers on their own (minidist/plan/hardware.py): which mpirun probe a
process count uses (the exact one, the next larger, or the largest stretched), the cores' worth
thread ranks get at each count and at the CPU boundary, a probe's link by algorithm, and the
refusals of an unknown preset and a missing calibration -- every expected value worked out here."""

import pytest

from minidist.plan.hardware import H100, Crowd, Link, get, here


def _probe(ranks, cores, fg, bg=None):
    return Crowd(ranks, cores, {"ring": {"fg": Link(1e9, fg), "bg": Link(2e9, bg or fg)},
                                "tree": {"fg": Link(1e9, fg / 2), "bg": Link(1e9, fg / 2)}}, 0.1)


HW = H100.with_(crowds=(_probe(4, 1.5, 4e-3), _probe(2, 1.0, 1e-3)))  # out of order on purpose


@pytest.mark.parametrize("ranks, probe, latency", [
    (2, 2, 1e-3),      # a probed count: its own probe
    (4, 4, 4e-3),
    (3, 4, 4e-3),      # between: the next larger (a little pessimistic)
    (8, 8, 8e-3),      # beyond the largest (4): its cores, every round 8 / 4 = 2x as long
    (6, 6, 6e-3),      # 6 / 4 = 1.5x
])
def test_the_probe_a_process_count_uses(ranks, probe, latency):
    c = HW.crowd(ranks)
    assert c.ranks == probe and c.link("ring", background=False).latency == pytest.approx(latency)
    assert c.cores == (1.0 if probe == 2 else 1.5) and c.python == 0.1
    assert c.link("ring", background=False).bandwidth == 1e9  # a stretch is per round, not per byte


def test_no_probe_for_one_rank_or_an_unprobed_machine_and_the_ring_link_for_an_unprobed_algorithm():
    assert HW.crowd(1) is None and HW.crowd(0) is None and H100.crowd(4) is None
    c = HW.crowd(2)
    assert c.link("tree", background=True).latency == 0.5e-3
    assert c.link("halving_doubling", background=True) == c.link("ring", background=True)
    assert c.link("ring", background=True).bandwidth == 2e9


@pytest.mark.parametrize("ranks, cores", [(1, 1.4), (2, 1.4), (3, 1.2), (4, 1.2), (5, 0.5), (9, 0.5)])
def test_thread_cores_per_measured_count_then_the_next_larger_then_crowded(ranks, cores):
    """calibrate measured 2 ranks at 1.4 cores and 4 at 1.2 (listed out of order): a count takes the
    smallest measured count at or above it; past the largest, with more ranks than the 4 CPUs, the
    crowded figure (0.5)."""
    hw = H100.with_(cpus=4, cores=1.9, cores_crowded=0.5, threads=((4, 1.2), (2, 1.4)))
    assert hw.thread_cores(ranks) == cores


@pytest.mark.parametrize("ranks, cores", [(1, 1.9), (2, 1.9), (3, 0.5), (8, 0.5)])
def test_thread_cores_of_an_older_calibration_change_only_past_the_cpus(ranks, cores):
    """No per-count list: `cores` while the ranks fit the 2 CPUs (2 ranks on 2 CPUs still fit), the
    crowded figure from 3 on; without a crowded figure, `cores` always."""
    hw = H100.with_(cpus=2, cores=1.9, cores_crowded=0.5)
    assert hw.thread_cores(ranks) == cores
    assert hw.with_(cores_crowded=0).thread_cores(ranks) == 1.9


def test_unknown_presets_and_a_missing_calibration_are_refused_naming_what_to_do(tmp_path):
    assert get("H100") is H100 and get("tpu-v5p").name == "TPU v5p"
    with pytest.raises(ValueError, match="unknown hardware 'h200'; choose one of a100, h100, b200, tpu-v4, "
                                         "tpu-v5e, tpu-v5p or 'here'"):
        get("h200")
    with pytest.raises(FileNotFoundError, match=r"no calibration at .*nothing.json: run `python -m "
                                                r"minidist.calibrate` first"):
        here(str(tmp_path / "nothing.json"))
