"""Lesson 9 on the virtual clock: speculative decoding's time is its passes' (and its speed-up the
formula's within 10% under a device model); disaggregated serving's TPOT beside its formulas, lower
than colocated with long prompts -- exactly, every run, under a device model."""

import re
import types

import numpy as np
import pytest

from minidist.comm import run
from minidist.infer import SpecStats, early_exit_draft, generate, speculative_generate
from minidist.nn import GPT, GPTConfig
from minidist.trace.spans import now

OPS = "tflops=1e9,gBps=1e9,overhead_us=100,name=ops"  # every op 100 us, FLOPs and bytes free
CPU_LIKE = "tflops=0.02,gBps=10,overhead_us=20,name=cpu-like"  # a slow device: a long prefill costs


@pytest.fixture
def device(monkeypatch):
    from minidist.comm.transports import link

    for name in ("MINIDIST_CLOCK", "MINIDIST_LINK", "MINIDIST_DEVICE"):
        monkeypatch.setenv(name, "")
    monkeypatch.setenv("MINIDIST_CLOCK", "virtual")
    monkeypatch.setattr(link, "_CURRENT", [])

    def use(spec, link_spec="alpha_us=5,gBps=450"):
        monkeypatch.setenv("MINIDIST_DEVICE", spec)
        monkeypatch.setenv("MINIDIST_LINK", link_spec)
        monkeypatch.setattr(link, "_CURRENT", [])
    return use


def model(layers=2, d=32, block=80, seed=0):
    cfg = GPTConfig(vocab_size=256, block_size=block, n_layer=layers, n_head=4, d_model=d, seed=seed)
    return GPT(cfg).eval()


def test_speculative_time_is_its_passes_on_a_device_of_fixed_op_costs(device):
    """Every op 100 us: a target pass costs n_t ops, a draft pass n_d, whatever the tokens in it; so
    the target alone takes n passes (the prefill and n - 1 decodes) and speculative decoding exactly
    target_passes·n_t + draft_passes·n_d -- the formula's cost model, k·c + 1 per round, with c =
    n_d / n_t."""
    device(OPS)
    target = model()
    draft = early_exit_draft(target, 1)
    prompt, n = [3, 1, 4, 1, 5], 12

    def body(comm):
        def timed(fn):
            t = now()
            fn()
            return now() - t
        one_t = timed(lambda: generate(target, [prompt], 1))   # a prefill: one pass
        one_d = timed(lambda: generate(draft, [prompt], 1))
        st = SpecStats()
        alone = timed(lambda: generate(target, [prompt], n))
        spec = timed(lambda: speculative_generate(target, draft, [prompt], n, k=3, stats=st))
        return one_t, one_d, alone, spec, st
    one_t, one_d, alone, spec, st = run(body, ranks=1)[0]
    assert one_t > one_d > 0 and (one_t / 1e-4) == pytest.approx(round(one_t / 1e-4))
    assert alone == pytest.approx(n * one_t)
    assert spec == pytest.approx(st.target_passes * one_t + st.draft_passes * one_d)


def test_speculative_section_is_within_10_percent_of_the_formula_on_h100(device, capsys):
    from minidist.lessons.cli import device_spec
    from minidist.lessons.inference_speculative import speculative

    device(device_spec("h100"))
    args = types.SimpleNamespace(speculative=4, draft_layers=1, layers=2, seed=0)
    target = trained()
    ok = run(lambda comm: speculative(target, early_exit_draft(target, 1), args, comm.clock), ranks=1)[0]
    out = capsys.readouterr().out
    found = re.search(r"measured ([\d.]+)x, formula .* = ([\d.]+)x: within 10%", out)
    measured, formula = float(found.group(1)), float(found.group(2))
    assert ok and "within 10%, PASS" in out and abs(measured / formula - 1) <= 0.10


def trained():
    """A small byte-level GPT trained briefly on the lesson's text (its draft agrees often enough)."""
    from minidist.lessons.inference_kv import TOK
    from minidist.lessons.train import train
    from minidist.nn.data import BatchLoader, TextDataset

    m = GPT(GPTConfig(vocab_size=TOK.vocab_size, block_size=64, n_layer=2, n_head=4, d_model=32, seed=0))
    train(m, BatchLoader(TextDataset.from_file(None, block_size=64), 16, seed=0), 80, 3e-3, log=False)
    return m.eval()


def _section6(ranks):
    from minidist.lessons.inference_disaggregated import disaggregation

    args = types.SimpleNamespace(disaggregate=(ranks // 2, ranks - ranks // 2), block=80, heads=4,
                                 kv_heads=4)
    target = model(d=96, seed=1)  # the lesson's size; the tokens do not matter here, the times do
    return run(lambda comm: disaggregation(comm, target, args), ranks=ranks)[0]


@pytest.mark.parametrize("ranks", [2, 4])
def test_disaggregated_tpot_is_lower_with_long_prompts_as_the_formulas_say(device, capsys, ranks):
    """On a slow device (a 67-token prefill costs several decode steps) and an NVLink: every steady
    TPOT inside its formula's range, disaggregated below colocated for long prompts, PASS; a second
    run prints the same numbers (the virtual clock, not the host, decides when a cache is taken)."""
    device(CPU_LIKE)
    assert _section6(ranks)
    out = capsys.readouterr().out
    assert "formulas: lower; each within 15% of its formula: PASS" in out and "(outside)" not in out
    found = re.search(r"disaggregated steady TPOT ([\d.]+) us < colocated ([\d.]+)", out)
    dis, colo = float(found.group(1)), float(found.group(2))
    assert dis < 0.85 * colo
    assert _section6(ranks) and capsys.readouterr().out == out


def test_the_section_is_shown_not_checked_in_cpu_time(device, capsys):
    device("")
    assert _section6(2)
    out = capsys.readouterr().out
    assert "shown, not checked" in out and "serial twin: disaggregated == colocated token for token" in out
    np.testing.assert_equal(out.count("PASS"), 1)
