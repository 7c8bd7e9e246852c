"""Recomputation's cost on the virtual clock (chapter 6): a policy costs one more forward of what it
recomputes -- a whole block (full, sqrt) or the attention core (selective) -- and nothing else.

Hand-worked on a device where every op costs 100 us and FLOPs and bytes nothing: a step's time is
its op count x 100 us, so full recomputation adds exactly L blocks' forward ops and selective L
attention cores (one fused op each), counted here by watching the ops run."""

import re

import numpy as np
import pytest

from minidist.autograd import meter
from minidist.comm import run
from minidist.nn.gpt import GPT, GPTConfig
from minidist.parallel.memory.recompute import Recompute, apply_recompute
from minidist.trace.spans import now

CFG = GPTConfig(vocab_size=32, block_size=16, n_layer=3, n_head=2, d_model=16, dropout=0.1, seed=1)
OP = 1e-4  # seconds an op on the device below


@pytest.fixture
def ops_device(monkeypatch):
    for name in ("MINIDIST_CLOCK", "MINIDIST_LINK", "MINIDIST_DEVICE"):
        monkeypatch.setenv(name, "")
    monkeypatch.setenv("MINIDIST_CLOCK", "virtual")
    monkeypatch.setenv("MINIDIST_DEVICE", "tflops=1e9,gBps=1e9,overhead_us=100,name=ops")


def count_ops(fn) -> int:
    """How many ops (forward and backward) ``fn`` runs that move data, watched through autograd's op
    meter: not the recomputation node itself (it runs the ops it recomputes), nor a view (a reshape
    or a slice whose output is its input's memory: a device launches nothing for it)."""
    seen = []

    def watch(op, ins, outs, backward):
        outs = [a for a in (outs if isinstance(outs, tuple) else (outs,)) if a is not None]
        view = all(any(np.shares_memory(a, x) for x in ins if isinstance(x, np.ndarray)) for a in outs)
        if op is not Recompute and not view:
            seen.append(op)
    meter.install(watch)
    try:
        fn()
    finally:
        meter.install(None)
    return len(seen)


def test_a_policy_costs_one_forward_of_what_it_recomputes(ops_device):
    idx = np.random.default_rng(0).integers(0, 32, (2, 16))
    x = np.random.default_rng(1).standard_normal((2, 16, 16)).astype(np.float32)
    from minidist.autograd import ops
    from minidist.autograd.tensor import Tensor

    plain = count_ops(lambda: GPT(CFG).loss(idx, idx).backward())
    block = count_ops(lambda: GPT(CFG)[1](Tensor(x)))
    core = count_ops(lambda: ops.packed_attention(Tensor(np.ones((2, 16, 48), np.float32)), 2))
    assert core == 1  # one fused op

    def step(policy):
        def body(comm):
            model = apply_recompute(GPT(CFG), policy)
            t = now()
            model.loss(idx, idx).backward()
            return now() - t
        return run(body, ranks=1)[0]

    assert step("none") == pytest.approx(plain * OP)
    assert step("full") == pytest.approx((plain + CFG.n_layer * block) * OP)
    assert step("selective") == pytest.approx((plain + CFG.n_layer * core) * OP)


def test_the_lesson_checks_its_time_ratios_on_a_device_model(monkeypatch, capsys):
    """``--clock virtual --device h100``: every policy's step-time ratio equals 1 + L·(its recomputed
    forward)/(F + B) (printed beside it), and the lesson says PASS; selective costs a few percent."""
    from minidist.lessons.checkpointing import main

    for name in ("MINIDIST_CLOCK", "MINIDIST_LINK", "MINIDIST_DEVICE"):
        monkeypatch.setenv(name, "")
    main(["--ranks", "2", "--layers", "4", "--dim", "32", "--seq", "32", "--batch", "2", "--repeats", "1",
          "--clock", "virtual", "--device", "h100"])
    out = capsys.readouterr().out
    row = r"^(none|full|sqrt|selective)\s+[\d,]+\s+[\d,]+\s+[\d.]+x\s+[\d.]+\s+([\d.]+x\s+[\d.]+)x"
    rows = dict(re.findall(row, out, re.M))
    ratios = {k: tuple(float(v) for v in r.split("x")) for k, r in rows.items()}
    assert set(ratios) == {"none", "full", "sqrt", "selective"}
    for policy, (measured, formula) in ratios.items():
        assert measured == pytest.approx(formula, rel=0.02), (policy, measured, formula)
    assert ratios["full"][0] == ratios["sqrt"][0] > 1.2 and 1.0 < ratios["selective"][0] < 1.1
    assert "on the device model: PASS" in out and "FAIL" not in out
