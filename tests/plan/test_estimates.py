"""minidist.plan.estimates against numbers worked by hand (chapter 0) and published figures."""

import numpy as np
import pytest

from minidist.plan import estimates as E


def test_six_nd_and_mfu_of_a_worked_example():
    # GPT-3 175B on 300B tokens: 6·175e9·300e9 = 3.15e23 FLOPs (Brown et al. 2020, Table D.1: 3.14e23)
    assert E.training_flops(175e9, 300e9) == pytest.approx(3.15e23)
    # 1B parameters, 1M tokens per step, 10 s per step on 8 chips of 1e15 FLOP/s: 6e15/10/8e15 = 7.5%
    assert E.mfu(1e9, 1e6, 10.0, 8e15) == pytest.approx(0.075)


@pytest.mark.parametrize("stage,dp,want", [
    (0, 8, 16.0), (1, 8, 2 + 2 + 12 / 8), (2, 8, 2 + 14 / 8), (3, 8, 16 / 8), (3, 1, 16.0),
])
def test_mixed_precision_bytes_per_parameter_by_zero_stage(stage, dp, want):
    m = E.training_memory(1.0, "mixed", stage, dp)
    assert m["total"] == pytest.approx(want)
    assert m["params"] + m["grads"] + m["optimizer"] == pytest.approx(m["total"])


def test_fp32_is_16_bytes_and_the_zero_paper_example():
    assert E.training_memory(1.0, "fp32")["total"] == 16
    # ZeRO paper Fig. 1: 7.5B parameters, 64 GPUs: 120 GB baseline, 31.4 GB stage 1, 16.6 stage 2, 1.9 stage 3
    psi = 7.5e9
    for stage, gb in [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)]:
        assert E.training_memory(psi, "mixed", stage, 64)["total"] / 1e9 == pytest.approx(gb, rel=0.02)
    with pytest.raises(ValueError, match="zero_stage"):
        E.training_memory(1, "mixed", 4)


def test_activations_follow_korthikanti():
    s, b, h, a = 2048, 1, 12288, 96  # GPT-3 175B layer
    assert E.activation_bytes_per_layer(s, b, h, a) == 34 * s * b * h + 5 * a * s * s * b
    assert E.activation_bytes_per_layer(s, b, h, a, recompute="selective") == 34 * s * b * h
    assert E.activation_bytes_per_layer(s, b, h, a, recompute="full") == 2 * s * b * h
    assert E.activation_bytes_per_layer(s, b, h, a, tp=8) == (34 * s * b * h + 5 * a * s * s * b) / 8


def test_roofline_of_a_matmul_and_a_decode_step():
    assert E.matmul_intensity(4096, 4096, 4096) == pytest.approx(4096 / 3)
    assert E.decode_intensity(1) == 1.0 and E.decode_intensity(64) == 64.0  # 2B/itemsize, bf16
    ridge = E.ridge_point(989e12, 3.35e12)  # H100: ~295 FLOPs per byte
    assert ridge == pytest.approx(295.2, rel=1e-3)
    t, bound = E.roofline_time(2 * 7e9, 2 * 7e9, 989e12, 3.35e12)  # 7B decode at batch 1
    assert bound == "memory" and t == pytest.approx(14e9 / 3.35e12)
    assert E.roofline_time(1e15, 1.0, 1e15, 1e12) == (1.0, "compute")


def test_alpha_beta_fit_recovers_the_constants_it_was_given():
    rounds = np.array([2, 2, 6, 6, 14])
    sent = np.array([1e3, 1e6, 1e3, 4e6, 2e7])
    t = rounds * 30e-6 + sent * 2e-10
    alpha, beta = E.fit_alpha_beta(rounds, sent, t)
    assert alpha == pytest.approx(30e-6) and beta == pytest.approx(2e-10)
    assert E.fit_alpha_beta(rounds, sent, t, relative=True) == pytest.approx((30e-6, 2e-10))
    assert E.ring_time(4e6, 4, alpha, beta) == pytest.approx(6 * 30e-6 + 1.5 * 4e6 * 2e-10)
    assert E.ring_time(4e6, 1, alpha, beta) == 0.0


def test_predicted_vs_measured_line():
    line = E.predicted_vs_measured("step", 0.002, 0.003)
    assert line == "step: predicted 2.00 ms, measured 3.00 ms (1.50x)"


def test_the_chapter_zero_tables_print(capsys):
    from minidist.plan.hardware import PRESETS

    rows = E.hardware_table()
    assert len(rows) == len(PRESETS) + 1 and "H100" in "".join(rows) and "TPU v5p" in "".join(rows)
    E.main([])
    out = capsys.readouterr().out
    assert "6·N·D = 8.40e+22" in out and "ZeRO-3 over 64 ranks" in out


def test_the_chapter_zero_roofline_is_drawn(capsys, tmp_path):
    out = tmp_path / "roofline.png"
    E.main(["--plot", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"roofline drawn to {out}" in capsys.readouterr().out
