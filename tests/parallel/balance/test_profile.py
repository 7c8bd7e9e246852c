"""``ProfiledStage``: each layer's forward and backward timed while training, on the real clock (lower
bounds, whatever the load) and on a virtual clock (exact: each backward charged to its own layer)."""

import pytest

from minidist.nn import GPT
from minidist.parallel.balance import profile
from minidist.parallel.balance.profile import ProfiledStage
from minidist.resilience.stragglers import Slowdown
from tests.parallel.balance.helpers import PCFG, make_batches, virtual_clock


def test_profiled_stage_times_each_layers_forward_and_backward():
    model = GPT(PCFG)
    pace, rows = 0.002, 2  # every layer's forward lasts >= 4 ms; layer 3 is 4x that; backward ~ 2x forward
    stage = ProfiledStage(model, [(0, len(model))], 0, 1, slow=Slowdown("layer=3,factor=4", pace=pace))
    x, y = make_batches(rows, 1)[0]
    stage.loss_fn(stage.forward(x), y).backward()
    fwd, bwd = stage.fwd, stage.bwd
    for i in range(len(model)):  # a loaded machine only adds time: lower bounds (exact: the virtual clock)
        assert fwd[i] >= rows * pace * (4 if i == 3 else 1), (i, fwd[i])
        assert bwd[i] > 0, (i, bwd[i])  # measured by the hooks
    # which layer a backward is charged to: the virtual-clock test below (wall time under load cannot tell)


def test_profiled_stage_charges_each_backward_to_its_own_layer(monkeypatch):
    """On a virtual clock the emulated times are exact, whatever the machine's load: layer i's forward
    lasts rows * pace * factor_i and its backward twice that (the first layer's backward is the 2x
    estimate); a hook that charged a backward to a neighbour would move layer 3's 4x to layer 2 or 4."""

    virtual_clock(monkeypatch, profile)
    model = GPT(PCFG)
    pace, rows = 0.002, 2
    stage = ProfiledStage(model, [(0, len(model))], 0, 1, slow=Slowdown("layer=3,factor=4", pace=pace))
    x, y = make_batches(rows, 1)[0]
    stage.loss_fn(stage.forward(x), y).backward()
    want = [0.004, 0.004, 0.004, 0.016, 0.004, 0.004]  # Embed, Block x 4 (the third 4x), Head
    assert [stage.fwd[i] for i in range(len(model))] == pytest.approx(want)
    assert [stage.bwd[i] for i in range(len(model))] == pytest.approx([2 * w for w in want])
