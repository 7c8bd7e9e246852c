"""Every schedule by name: what it builds, how many chunks a rank holds, and that it trains on a mesh."""

import numpy as np
import pytest

from minidist.comm import run
from minidist.nn import GPTConfig
from minidist.parallel.pipeline.catalog import SCHEDULES, make_schedule, schedule_chunks
from minidist.parallel.pipeline.placement import looped, v_shape
from minidist.parallel.pipeline.schedule import ScheduleError
from minidist.parallel.three_d import gather_full_state, max_state_diff, train_3d, train_serial


def test_names_placements_and_chunks():
    assert set(SCHEDULES) == {"gpipe", "1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipe-v"}
    for name in ("gpipe", "1f1b", "zb-h1", "zb-h2"):
        assert make_schedule(name, 3, 6).placement == looped(3) and schedule_chunks(name) == 1
    for name in ("zb-v", "dualpipe-v", "zb_v", "dualpipe_v"):
        assert make_schedule(name, 3, 6).placement == v_shape(3) and schedule_chunks(name) == 2
    assert make_schedule("interleaved", 2, 4, 3).placement == looped(2, 3)
    assert schedule_chunks("interleaved", 3) == 3
    with pytest.raises(ScheduleError, match="unknown schedule 'dualpipe': use one of 'interleaved', 'gpipe'"):
        make_schedule("dualpipe", 2, 4)


CFG = GPTConfig(vocab_size=16, block_size=4, n_layer=2, n_head=2, d_model=8, dtype="float64")


def _train_rank(comm, batches, n_layer, **kw):
    result = train_3d(comm, CFG.replace(n_layer=n_layer), batches, lr=0.1, optimizer="adamw", **kw)
    return gather_full_state(comm, result), result.losses


@pytest.mark.parametrize("schedule,dp,pp,tp,m,n_layer", [
    ("zb-v", 2, 2, 1, 2, 2), ("dualpipe-v", 2, 2, 1, 4, 2), ("zb-h2", 2, 2, 1, 3, 2),
    ("zb-v", 1, 3, 1, 3, 4), ("dualpipe-v", 1, 2, 2, 4, 2)])
def test_new_schedules_compose_with_ddp_and_tp(schedule, dp, pp, tp, m, n_layer):
    """dp x pp (x tp) meshes, 2pp pieces for a V: DDP syncs on each chunk's last W, the loss comes from
    the rank holding the last piece (pp rank 0 in a V). Parameters and losses equal the serial
    model's over two AdamW steps."""
    rng = np.random.default_rng(m + pp)
    rows = 2 * dp * m
    batches = [(rng.integers(0, 16, (rows, 4)), rng.integers(0, 16, (rows, 4))) for _ in range(2)]
    want, want_losses = train_serial(CFG.replace(n_layer=n_layer), batches, lr=0.1, optimizer="adamw")
    results = run(_train_rank, ranks=dp * pp * tp, batches=batches, n_layer=n_layer, dp=dp, pp=pp, tp=tp,
                  microbatches=m, schedule=schedule)
    state, losses = results[0]
    assert max_state_diff(state, want) <= 1e-9
    np.testing.assert_allclose(losses, want_losses, rtol=0, atol=1e-9)
