"""The line "formula X, this machine predicted Y (N ranks on C cores), measured Z" that lessons 3 and 4
print: its numbers are the planner's two models (a core per rank, and the machine as it is)."""

import re

from minidist.lessons import data_parallel, tensor_parallel
from minidist.lessons.this_machine import compare_line, textbook
from minidist.plan import hardware
from minidist.plan.mesh import Candidate, Settings
from minidist.plan.model import ModelSpec
from minidist.plan.steptime import predict, rank_slowdown

# a machine whose 2 cores the ranks share, no GIL, no probes: each of N ranks runs N / 2 times slower
SHARED = hardware.get("a100").with_(cores=2, cpus=2, gil=False)
NUMBER = r"([0-9.e+-]+) ms"


def planner(hw, n_layer, d_model, vocab, seq, batch, dp=1, tp=1, microbatches=1, dtype_bytes=4):
    """The planner's step time, called as chapter 11 does: a minidist GPT on a dp x tp mesh."""
    model = ModelSpec("t", n_layer=n_layer, d_model=d_model, n_head=4, vocab=vocab, seq=seq,
                      engine="minidist", dtype_bytes=dtype_bytes)
    return predict(model, Candidate(dp=dp, tp=tp, microbatch_size=batch // (dp * microbatches)), batch, hw,
                   Settings("adamw")).step


def numbers(line):
    m = re.search(rf"formula {NUMBER} .*this machine predicted {NUMBER} \((\d+) ranks? on (\d+) cores: "
                  rf"each rank's work ([0-9.]+)x slower\), measured {NUMBER}", line)
    assert m, line
    return float(m[1]), float(m[2]), int(m[3]), int(m[4]), float(m[5]), float(m[6])


def close(printed: float, seconds: float) -> bool:  # printed with 3 significant digits
    return abs(printed - seconds * 1e3) <= 5e-3 * seconds * 1e3


def test_the_line_holds_the_planners_two_models_and_the_ranks_per_core():
    shape = dict(n_layer=2, d_model=64, vocab=64, seq=32, batch=16, dp=4, microbatches=2)
    line = compare_line("DDP step", 0.05, 4, SHARED, n_head=4, **shape)
    formula, here, ranks, cores, slow, measured = numbers(line)
    one_core_each = SHARED.with_(cores=0, cpus=0)  # the textbook's machine: nothing shared
    assert close(formula, planner(one_core_each, **shape)) and close(here, planner(SHARED, **shape))
    assert (ranks, cores, slow, measured) == (4, 2, 4 / 2, 50.0)
    assert here > formula  # sharing the cores can only make the step longer


def test_the_textbook_machine_shares_nothing():
    mine = hardware.get("a100").with_(cores=0.5, cpus=2, gil=True, cores_one=0.8, threads=((4, 1.5),))
    assert rank_slowdown(textbook(mine), 8) == 1.0 and rank_slowdown(mine, 4) == 4 / 1.5


def test_without_a_calibration_the_line_says_how_to_get_one():
    line = compare_line("DDP step", 0.0123, 1, None)
    assert "measured 12.3 ms (1 rank on" in line and "python -m minidist.calibrate" in line


def test_data_parallel_prints_the_planners_prediction_for_its_run(monkeypatch, capsys):
    monkeypatch.setattr(data_parallel, "this_machine", lambda transport: SHARED)
    data_parallel.main("--ranks 2 --batch 6 --steps 1 --accum 1 --seq 8 --d-model 16 --layers 1 "
                       "--overlap-d-model 16 --overlap-layers 1 --overlap-rows 2".split())
    line = next(x for x in capsys.readouterr().out.splitlines() if "DDP step" in x)
    formula, here, ranks, cores, slow, _ = numbers(line)
    shape = dict(n_layer=1, d_model=16, vocab=64, seq=8, batch=6, dp=2, microbatches=1, dtype_bytes=8)
    assert close(formula, planner(SHARED.with_(cores=0), **shape)) and close(here, planner(SHARED, **shape))
    assert (ranks, cores, slow) == (2, 2, 1.0)


def test_tensor_parallel_prints_the_planners_prediction_per_tp(monkeypatch, capsys):
    monkeypatch.setattr(tensor_parallel, "this_machine", lambda transport: SHARED)
    tensor_parallel.main("--ranks 4 --steps 1 --seq 8 --d-model 16 --layers 1".split())
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("TP step, tp=")]
    assert [x.split(":")[0] for x in lines] == ["TP step, tp=1", "TP step, tp=2", "TP step, tp=4"]
    for tp, line in zip((1, 2, 4), lines):
        formula, here, ranks, cores, slow, _ = numbers(line)
        shape = dict(n_layer=1, d_model=16, vocab=256, seq=8, batch=4, tp=tp)
        assert close(formula, planner(SHARED.with_(cores=0), **shape))
        assert close(here, planner(SHARED, **shape))
        assert (ranks, slow) == (tp, max(1.0, tp / 2))
