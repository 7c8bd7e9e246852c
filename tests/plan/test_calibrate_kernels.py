"""calibrate_kernels' step timer, on a tiny GPT (the machine's speed never enters)."""

import time

import numpy as np

from minidist.comm import run
from minidist.nn import GPTConfig
from minidist.plan import calibrate_kernels


def test_step_seconds_times_each_step_after_the_warm_up():
    """One value per step after the first (from one step's end to the next), less the dropped ones;
    each positive, together no more than the call took."""
    cfg = GPTConfig(vocab_size=8, block_size=4, n_layer=1, n_head=2, d_model=8)
    ids = np.zeros((2, 4), dtype=np.int64)
    t0 = time.perf_counter()
    got = run(lambda comm: calibrate_kernels.step_seconds(comm, cfg, [(ids, ids)] * 5, drop=2, dp=2), ranks=2)
    wall = time.perf_counter() - t0
    assert [len(g) for g in got] == [5 - 1 - 2] * 2
    assert all(s > 0 for g in got for s in g) and max(sum(g) for g in got) < wall
