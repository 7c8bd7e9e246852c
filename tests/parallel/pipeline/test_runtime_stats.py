"""The runtime's memory accounting (StepStats) as sums over what each stage holds at once, not the
newest microbatch: the W-queue's peak bytes of ZB-H1 are (s + 1) queues on stage s."""

import numpy as np
import pytest

from minidist.nn import GPTConfig
from minidist.parallel.pipeline import split_backward
from tests.parallel.pipeline.conftest import pipeline_step

CFG = GPTConfig(vocab_size=16, block_size=4, n_layer=3, n_head=2, d_model=8, dtype="float64")


@pytest.mark.parametrize("p, m", [(3, 4), (2, 2)])
def test_zb_h1_w_queue_peak_bytes_are_all_the_queues_held_at_once(monkeypatch, p, m):
    """Every queue is made to weigh 1000 bytes: ZB-H1's stage s holds s + 1 queues between B and W
    at its fullest (W put off by s), so its peak is (s + 1)·1000 -- counted from one queue it would
    be 1000 on every stage."""
    monkeypatch.setattr(split_backward.WeightGradQueue, "nbytes", lambda self: 1000)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 16, (2 * m, 4)), rng.integers(0, 16, (2 * m, 4))
    stats, _ = pipeline_step("zb-h1", p, m, CFG, x, y)
    assert [s.peak_pending_weights for s in stats] == [min(m, s + 1) for s in range(p)]
    assert [s.peak_weight_queue_bytes for s in stats] == [1000 * min(m, s + 1) for s in range(p)]


def test_1f1b_keeps_no_w_queue_and_its_f_to_b_bytes_are_the_held_microbatches():
    rng = np.random.default_rng(1)
    x, y = rng.integers(0, 16, (8, 4)), rng.integers(0, 16, (8, 4))
    stats, _ = pipeline_step("1f1b", 2, 4, CFG, x, y)
    for s, st in enumerate(stats):
        assert st.peak_weight_queue_bytes == 0 and st.peak_pending_weights == 0
        one = st.activation_bytes[(0, 0)]
        assert one > 0 and st.peak_microbatches == 2 - s and st.peak_fb_bytes == (2 - s) * one
