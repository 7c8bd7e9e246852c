"""The pipeline lesson on the virtual clock: each schedule's measured bubble beside its formula and its
simulator at the op costs the run measured, judged PASS/FAIL; the plot's title and colours; the
wording at dp = 1. A device model prices every op from its shapes, so the numbers do not depend on
the machine's load (no `timing` marker)."""

import re

import pytest

from minidist.lessons import pipeline
from minidist.lessons.pipeline_report import own_formula
from minidist.trace.timeline import _COLORS, _kind

# a device slow enough that a tiny model's ops, not its 20 us messages, set the pace; priced by
# FLOPs (no per-op overhead), so a block costs its matrix products and the head a sixth of a block
DEVICE = "tflops=0.0001,gBps=50,overhead_us=0,name=test device"
TINY = "--ranks 4 --dp 1 --steps 2 --width 16 --seq 8 --layers 8 --partition blocks --batch 8"


def run(capsys, monkeypatch, schedule: str, microbatches: int, device: bool = True,
        more=()) -> tuple[str, bool]:
    monkeypatch.setenv("MINIDIST_CLOCK", "wall")  # restored after the test: --clock sets it
    if device:
        monkeypatch.setenv("MINIDIST_DEVICE", DEVICE)
    else:
        monkeypatch.delenv("MINIDIST_DEVICE", raising=False)
    try:
        ok = all(pipeline.main([*TINY.split(), "--clock", "virtual", "--schedule", schedule,
                                "--microbatches", str(microbatches), *more]))
    except SystemExit as e:  # a check printed FAIL
        ok = e.code == 0
    return capsys.readouterr().out, ok


def bubbles(out: str) -> tuple[float, float, float]:
    """measured, formula, simulator as the lesson printed them."""
    m = re.search(r"measured ([0-9.]+) \(median .*?= ([0-9.]+)[ ;]", out)
    s = re.search(r"simulator at the op costs this run measured .*: ([0-9.]+)", out)
    assert m and s, out
    return float(m.group(1)), float(m.group(2)), float(s.group(1))


def test_1f1b_on_the_virtual_clock_meets_its_formula(capsys, monkeypatch):
    """p = 2, m = 4, four blocks a stage (width 64: the head a third of a block): 1F1B's bubble within
    0.03 of (p-1)/(m+p-1) = 1/5, judged PASS; under a device model the simulator fed the run's own
    op costs gives the measured bubble (the only difference: the link's queueing, not modelled)."""
    out, ok = run(capsys, monkeypatch, "1f1b", 4, more=["--ranks", "2", "--width", "64"])
    measured, formula, sim = bubbles(out)
    assert formula == pytest.approx(1 / 5, abs=5e-4)
    assert abs(measured - 1 / 5) <= 0.03 and abs(measured - sim) <= 0.01, out
    assert ok and re.search(r"1F1B's bubble .* within 0.03 of \(p-1\)/\(m\+p-1\) = 0.200  PASS", out)
    assert "step time" in out and "(virtual)" in out and re.search(r"wall clock: step time \d+ ms", out)


@pytest.mark.parametrize("schedule, m", [("zb-h1", 4), ("interleaved", 4), ("dualpipe-v", 8)])
def test_each_schedule_meets_its_simulator_at_the_measured_costs(capsys, monkeypatch, schedule, m):
    """Every other schedule is judged against its simulator at the measured costs (its formula
    assumes equal pieces), and ZB-H1's bubble is below 1F1B's on the same stages."""
    out, ok = run(capsys, monkeypatch, schedule, m)
    measured, _, sim = bubbles(out)
    assert ok and abs(measured - sim) <= 0.03, out
    assert re.search(r"bubble [0-9.]+ within 0.03 of its simulator's [0-9.]+  PASS", out)
    if schedule == "zb-h1":
        below = re.search(r"ZB-H1's bubble ([0-9.]+) below 1F1B's ([0-9.]+) .*PASS", out)
        assert below and float(below.group(1)) < float(below.group(2)) - 0.05, out


def test_in_cpu_time_1f1b_is_judged_by_its_simulator(capsys, monkeypatch):
    """Without a device model ops cost the CPU time they took, which varies with the machine: 1F1B
    is then judged against its simulator, and the lesson says how much one forward varied. (Not
    whether it passes: at this size the runtime's own Python between ops is a visible share.)"""
    out, _ = run(capsys, monkeypatch, "1f1b", 4, device=False)
    assert re.search(r"1f1b's bubble [0-9.]+ within 0.03 of its simulator's", out), out
    assert re.search(r"one forward.s cost varies \d+% here|the busiest stage computes \d+% more", out)


def test_uneven_stages_are_judged_by_the_simulator(capsys, monkeypatch):
    """Cut by layer count (embedding + 1 block, 2 blocks, 2 blocks, 1 block + head), the middle stages
    compute more than 10% above the mean stage: the formula's equal stages are not this run, so
    1F1B is judged by its simulator, and the lesson says why."""
    out, ok = run(capsys, monkeypatch, "1f1b", 4, more=["--layers", "6", "--partition", "uniform",
                                                         "--width", "64"])
    uneven = re.search(r"the busiest stage computes (\d+)% more than the mean", out)
    assert ok and uneven and int(uneven.group(1)) > 10, out
    assert re.search(r"1f1b's bubble [0-9.]+ within 0.03 of its simulator's [0-9.]+  PASS", out)


def test_the_plot_title_uses_the_schedules_own_formula():
    """ZB-H1's title names (p-1)/(3m+p-1) = 3/27 at p = 4, m = 8 -- not 1F1B's 3/11 -- and its
    simulator's value; ZB-V's (p-1)/(6m+p-1) = 3/51; interleaved v = 2: (p-1)/(v·m+p-1) = 3/19."""
    args = pipeline.main.__globals__["lesson_parser"]("x").parse_args([])
    args.chunks = 1
    for schedule, text, value in [("zb-h1", "(p-1)/(3m+p-1)", 3 / 27), ("zb-v", "(p-1)/(6m+p-1)", 3 / 51),
                                  ("1f1b", "(p-1)/(m+p-1)", 3 / 11), ("gpipe", "(p-1)/(m+p-1)", 3 / 11)]:
        args.schedule = schedule
        title = pipeline.plot_title(args, 4, 8, 0.2, 0.19)
        assert f"formula {text} = {value:.2f}" in title and "simulator 0.19" in title, title
    args.schedule, args.chunks = "interleaved", 2
    assert own_formula("interleaved", 4, 8, 2) == ("(p-1)/(v·m+p-1)", pytest.approx(3 / 19))
    assert "v=2" in pipeline.plot_title(args, 4, 8, 0.2, 0.19)


def test_the_plot_colours_b_and_w_apart():
    """A split backward's B and W are two colours (W was drawn as B), both apart from the forward."""
    colour = {name: _COLORS[_kind({"cat": "compute", "name": name})]
              for name in ("Forward", "Backward", "BackwardInput", "BackwardWeight")}
    assert colour["BackwardInput"] == colour["Backward"] != colour["Forward"]
    assert colour["BackwardWeight"] not in (colour["BackwardInput"], colour["Forward"])


def test_plot_is_written_with_the_title(capsys, monkeypatch, tmp_path):
    """--plot on the virtual clock writes the picture (the title comes from `plot_title`)."""
    monkeypatch.setenv("MINIDIST_CLOCK", "wall")
    monkeypatch.setenv("MINIDIST_DEVICE", DEVICE)
    path = tmp_path / "zb.png"
    assert all(pipeline.main([*TINY.split(), "--clock", "virtual", "--schedule", "zb-h1",
                              "--microbatches", "4", "--plot", str(path)]))
    assert path.stat().st_size > 10_000 and f"wrote {path}" in capsys.readouterr().out


@pytest.mark.parametrize("dp", [1, 2])
def test_wording_at_dp_1_and_2(capsys, dp):
    """dp = 1: no "1 replicas", no data-parallel all-reduce in the timeline's legend; dp = 2 names both."""
    argv = f"--ranks {2 * dp} --dp {dp} --steps 1 --width 16 --seq 8 --layers 2 --batch 8 --microbatches 2"
    assert all(pipeline.main(argv.split()))
    out = capsys.readouterr().out
    assert "1 replicas" not in out
    assert ("with the data-parallel all-reduce" in out) == (dp == 2)
    assert ("= 2 replicas x 2 microbatches of 2" in out) == (dp == 2)
    assert dp == 2 or "global batch 8 = 2 microbatches of 4" in out


def test_unset_flags_on_the_virtual_clock_take_the_formulas_world(monkeypatch):
    """On the virtual clock the lesson's defaults are equal stages (3 blocks each, cut by blocks) on
    this machine's roofline; the wall clock keeps 6 layers cut by count; a flag given is kept."""
    import argparse

    from minidist.lessons.pipeline import virtual_defaults

    monkeypatch.delenv("MINIDIST_CLOCK", raising=False)
    monkeypatch.delenv("MINIDIST_DEVICE", raising=False)

    def given(**kw):
        a = argparse.Namespace(clock=None, device=None, layers=None, partition=None, pp=None, dp=2, tp=1)
        vars(a).update(kw)
        return a
    a = given(clock="virtual")
    virtual_defaults(a, 8)
    assert (a.layers, a.partition, a.device) == (12, "blocks", "here")
    a = given(clock="virtual", dp=4, pp=16)
    virtual_defaults(a, 64)
    assert a.layers == 48
    a = given()
    virtual_defaults(a, 8)
    assert (a.layers, a.partition, a.device) == (6, "uniform", None)
    a = given(clock="virtual", device="cpu-time", layers=8, partition="uniform")
    virtual_defaults(a, 8)
    assert (a.layers, a.partition, a.device) == (8, "uniform", "cpu-time")
    monkeypatch.setenv("MINIDIST_CLOCK", "virtual")
    a = given()
    virtual_defaults(a, 8)
    assert a.device == "here"
    monkeypatch.setenv("MINIDIST_DEVICE", "tflops=1,gBps=1,overhead_us=0,name=mine")
    a = given()
    virtual_defaults(a, 8)
    assert a.device is None  # the environment's device model stays
