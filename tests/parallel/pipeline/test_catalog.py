"""Every schedule by name: what it builds, how many chunks a rank holds, and that it trains on a mesh."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist.comm import run
from minidist.nn import GPTConfig
from minidist.parallel.pipeline.catalog import SCHEDULES, make_schedule, schedule_chunks
from minidist.parallel.pipeline.placement import dual, looped, v_shape
from minidist.parallel.pipeline.schedule import (
    COMPUTE,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    ScheduleError,
)
from minidist.parallel.pipeline.simulate import simulate
from minidist.parallel.three_d import gather_full_state, max_state_diff, train_3d, train_serial
from tests.conftest import budget


def test_names_placements_and_chunks():
    assert set(SCHEDULES) == {"gpipe", "1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipe-v", "dualpipe"}
    for name in ("gpipe", "1f1b", "zb-h1", "zb-h2"):
        assert make_schedule(name, 3, 6).placement == looped(3) and schedule_chunks(name) == 1
    for name in ("zb-v", "dualpipe-v", "zb_v", "dualpipe_v"):
        assert make_schedule(name, 3, 6).placement == v_shape(3) and schedule_chunks(name) == 2
    assert make_schedule("dualpipe", 4, 8).placement == dual(4) and schedule_chunks("dualpipe") == 1
    assert make_schedule("interleaved", 2, 4, 3).placement == looped(2, 3)
    assert schedule_chunks("interleaved", 3) == 3
    with pytest.raises(ScheduleError, match="unknown schedule '2f2b': use one of 'interleaved', 'gpipe'"):
        make_schedule("2f2b", 2, 4)


MINIMUM = {"gpipe": lambda p: 1, "1f1b": lambda p: 1, "zb-h1": lambda p: p, "zb-h2": lambda p: 2 * p - 1,
           "zb-v": lambda p: p, "dualpipe-v": lambda p: 2 * p, "dualpipe": lambda p: 2 * p}  # as stated


@given(name=st.sampled_from(sorted(SCHEDULES)), p=st.integers(2, 8), extra=st.integers(0, 8))
@budget(40, deadline=None)
def test_every_schedule_is_deadlock_free_and_complete(name, p, extra):
    """Simulated as it declares its sends: no deadlock; on every rank each (mb, chunk) it holds runs
    one forward and either one whole backward or one B and one W (DualPipe: each microbatch through
    one copy, the first half copy 0's); one below the minimum is refused."""
    if name == "dualpipe":
        p, extra = p + p % 2, extra + extra % 2  # even sizes: half the microbatches enter at each end
    least = MINIMUM[name](p)
    m = least + extra
    sched = make_schedule(name, p, m)
    assert simulate(sched).makespan > 0
    v = sched.placement.chunks
    for ops in sched:
        done = sorted((type(i).__name__, i.mb, i.chunk) for i in ops if isinstance(i, COMPUTE))
        fwd = [(mb, c) for k, mb, c in done if k == Forward.__name__]
        want = [(mb, c) for mb in range(m) for c in range(v)] if name != "dualpipe" else \
            sorted((mb, int(mb >= m // 2)) for mb in range(m))
        assert sorted(fwd) == want
        whole = {(mb, c) for k, mb, c in done if k == Backward.__name__}
        split = {(mb, c) for k, mb, c in done if k == BackwardInput.__name__}
        assert split == {(mb, c) for k, mb, c in done if k == BackwardWeight.__name__}
        assert not whole & split and whole | split == set(fwd)
    if least > 1:
        with pytest.raises(ScheduleError, match=f"needs num_microbatches >= {least}"):
            make_schedule(name, p, least - (2 if name == "dualpipe" else 1))


CFG = GPTConfig(vocab_size=16, block_size=4, n_layer=2, n_head=2, d_model=8, dtype="float64")


def _train_rank(comm, batches, n_layer, **kw):
    result = train_3d(comm, CFG.replace(n_layer=n_layer), batches, lr=0.1, optimizer="adamw", **kw)
    return gather_full_state(comm, result), result.losses


@pytest.mark.parametrize("schedule,dp,pp,tp,m,n_layer", [
    ("zb-v", 2, 2, 1, 2, 2), ("dualpipe-v", 2, 2, 1, 4, 2), ("zb-h2", 2, 2, 1, 3, 2),
    ("zb-v", 1, 3, 1, 3, 4), ("dualpipe-v", 1, 2, 2, 4, 2), ("dualpipe", 2, 2, 1, 4, 2),
    ("dualpipe", 1, 4, 1, 8, 2), ("dualpipe", 1, 2, 2, 6, 2)])
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


@given(name=st.sampled_from(["zb-h1", "zb-h2", "zb-v", "dualpipe-v", "dualpipe"]), dp=st.integers(1, 2),
       pp=st.integers(2, 3), extra=st.integers(0, 2), more=st.integers(0, 1), seed=st.integers(0, 99))
@budget(5, deadline=None)
def test_drawn_meshes_train_like_the_serial_model(name, dp, pp, extra, more, seed):
    """Drawn schedule, dp x pp mesh (DDP over dp), microbatches from the schedule's minimum, depth
    enough for its pieces: two AdamW steps equal the serial model's."""
    if name == "dualpipe":
        pp, extra = 2, extra + extra % 2  # even sizes
    m = MINIMUM[name](pp) + extra
    n_layer = max(1, schedule_chunks(name) * pp - 2) + more
    rng = np.random.default_rng(seed)
    batches = [(rng.integers(0, 16, (dp * m, 4)), rng.integers(0, 16, (dp * m, 4))) for _ in range(2)]
    want, want_losses = train_serial(CFG.replace(n_layer=n_layer), batches, lr=0.1, optimizer="adamw")
    results = run(_train_rank, ranks=dp * pp, batches=batches, n_layer=n_layer, dp=dp, pp=pp, tp=1,
                  microbatches=m, schedule=name)
    state, losses = results[0]
    assert max_state_diff(state, want) <= 1e-9
    np.testing.assert_allclose(losses, want_losses, rtol=0, atol=1e-9)
