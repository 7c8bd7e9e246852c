"""Data parallelism with moving shares: equal to the serial twin whatever the shares, on JAX too; a
straggler that appears mid-run is named and loses rows -- asserted on the real clock as what holds
under any load plus each decision recomputed from the recorded times, and exactly on a virtual clock."""

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from minidist.comm import run
from minidist.nn.serial import host_state, max_state_diff, train_serial
from minidist.parallel.balance.dp import train_dp_balanced
from minidist.resilience.stragglers import Slowdown
from tests.conftest import budget
from tests.parallel.balance.helpers import CFG, TOL, best_split_time, make_batches, virtual_clock

# -- data parallel with moving shares == serial ---------------------------------------------------

@budget(6)
@given(data=st.data(), ranks=st.integers(2, 4), rows=st.integers(4, 10),
       optimizer=st.sampled_from(["sgd", "adamw"]))
@example(data=None, ranks=3, rows=6, optimizer="adamw")
def test_dp_equals_serial_whatever_the_shares(data, ranks, rows, optimizer):
    steps = 3
    if rows < ranks:
        rows = ranks
    batches = make_batches(rows, steps, seed=rows)
    plans = []
    for _ in range(steps):  # random share vectors, re-decided at random steps
        if data is None:
            cuts = list(range(1, ranks))
        else:
            cuts = sorted(data.draw(st.lists(st.integers(1, rows - 1), min_size=ranks - 1, max_size=ranks - 1,
                                             unique=True)))
        plans.append(np.diff([0, *cuts, rows]).tolist())
    want, want_losses = train_serial(CFG, batches, lr=0.1, optimizer=optimizer)

    def body(comm):
        r = train_dp_balanced(comm, CFG, batches, optimizer=optimizer, slow=None, plan=lambda s: plans[s])
        return host_state(r.model), r.losses, r.shares
    results = run(body, ranks=ranks)
    for state, losses, shares in results:
        assert max_state_diff(state, want) <= TOL
        np.testing.assert_allclose(losses, want_losses, rtol=0, atol=TOL)
        assert shares == plans


def test_dp_on_jax_pads_shares_to_a_few_shapes_and_equals_serial():
    """On JAX a rank's rows are padded to a power of two (ignored targets): shares that move compile
    nothing once their padded shapes have been met (3 and 5 rows run as 4 and 8; 4 and 4 then reuse
    rank 0's 4), and training still equals the serial twin."""
    pytest.importorskip("jax")
    from minidist.accel import jax_engine
    from minidist.parallel.balance.dp import pad_rows

    x, y = np.arange(6).reshape(3, 2), np.arange(6).reshape(3, 2) + 10
    px, py = pad_rows(x, y, 4)
    assert px.tolist() == [[0, 1], [2, 3], [4, 5], [0, 0]] and py.tolist()[-1] == [-1, -1]
    assert pad_rows(x, y, 3)[0] is x
    plans = [[3, 5], [5, 3], [4, 4]]
    batches = make_batches(8, len(plans), seed=1)
    want, want_losses = train_serial(CFG, batches, lr=0.1, optimizer="sgd")

    def body(comm):
        programs, rows = [], []

        def on_step(step, run, table):
            comm.barrier()
            programs.append(jax_engine.compilations())
            rows.append(table[:, run.monitor.fields.index("rows")].tolist())

        r = train_dp_balanced(comm, CFG, batches, optimizer="sgd", slow=None, plan=lambda s: plans[s],
                              on_step=on_step)  # (the rank's default backend: JAX)
        return host_state(r.model), r.losses, programs, rows

    for state, losses, programs, rows in run(body, ranks=2, backend="jax"):
        # the rows each step's time covers, padded: 3 rows take 4 rows' time (per-row cost not 4/3 too high)
        assert rows == [[4, 8], [8, 4], [4, 4]], rows
        assert max_state_diff(state, want) <= TOL
        np.testing.assert_allclose(losses, want_losses, rtol=0, atol=TOL)
        if jax_engine.enabled():
            assert programs[2] == programs[1], programs  # step 2: shapes met at steps 0 and 1


def recorded_seconds_per_row(history, step, window):
    """Per rank: the median over the window ending at ``step`` of compute / rows, from the tables the
    monitor recorded (its fields: compute, wait, rows, ...): what the balancer and the detector saw."""
    recent = [t[:, 0] / t[:, 2] for t in history[max(0, step - window + 1):step + 1]]
    return np.median(recent, axis=0)


def _train_with_straggler(monkeypatch=None):
    """24 rows on 3 ranks for 8 steps, rank 2 four times slower from step 2; on every rank: the state,
    the shares, the stragglers and the monitor's recorded tables."""
    from minidist.parallel.balance import dp

    if monkeypatch is not None:
        virtual_clock(monkeypatch, dp)
    batches = make_batches(24, 8, seed=1)
    slow = Slowdown("rank=2,factor=4,from_step=2", pace=0.003)

    def body(comm):
        r = train_dp_balanced(comm, CFG, batches, slow=slow, every=2, window=2, margin=0.1, threshold=0.5,
                              patience=2)
        return host_state(r.model), r.shares, r.stragglers, r.monitor.history
    return batches, run(body, ranks=3)


def test_dp_straggler_appears_is_named_and_loses_rows_and_training_still_equals_serial():
    """On the real clock, whatever the load: the straggler loses rows, is named, training equals the
    serial twin, and every decision is the one a formula takes on the times the balancer measured."""
    batches, results = _train_with_straggler()
    want, _ = train_serial(CFG, batches, lr=0.1)
    state, shares, stragglers, history = results[0]
    assert max_state_diff(state, want) <= TOL
    assert all(r[1] == shares and r[2] == stragglers for r in results)  # the same decisions on every rank
    # the window (2 steps) holds step 0 until step 2, so the first decision is after step 3
    assert shares[:4] == [[8, 8, 8]] * 4
    # rank 2's emulated work lasts 4x its own real work (or 4x its pace): it loses rows and is named
    assert shares[-1][2] < 8 and sum(shares[-1]) == 24, shares
    assert any(2 in named for named in stragglers), stragglers
    # every decision recomputed from the recorded tables: after steps 3 and 5 (every 2 steps) the shares
    # move iff the best whole split beats the current one's max_i n_i t_i by more than the 10% margin
    for step in range(len(shares) - 1):
        before, after = shares[step], shares[step + 1]
        if step < 2 or (step + 1) % 2:
            assert after == before, (step, shares)
            continue
        t = recorded_seconds_per_row(history, step, window=2)
        now, best = max(np.multiply(before, t)), best_split_time(24, 1 / t, 1)
        assert (after != before) == (best < 0.9 * now), (step, before, after, t)
        if after != before:
            assert max(np.multiply(after, t)) == pytest.approx(best), (step, after, t)
    # the detector recomputed: a rank is named once its seconds per row exceed 1.5x the ranks' median
    # for 2 steps in a row
    run_length, named = [0, 0, 0], []
    for step in range(len(shares)):
        t = recorded_seconds_per_row(history, step, window=2)
        run_length = [n + 1 if v > 1.5 * np.median(t) else 0 for n, v in zip(run_length, t)]
        named.append([r for r, n in enumerate(run_length) if n >= 2])
    assert stragglers == named


def test_dp_straggler_on_a_virtual_clock_gets_the_best_whole_split(monkeypatch):
    """Each rank's clock passes only the emulated time (pace x rows x factor), so the numbers are exact:
    a row costs 3 ms on ranks 0 and 1 and 12 ms on rank 2 from step 2. After step 3 (the first window
    without step 0) 24 rows at speeds (1, 1, 1/4): rank 2 with 2 rows (8 row-times) leaves 11 + 11; with
    1 row the others need 12 (23 rows), with 3 rank 2 needs 12: [11, 11, 2] is the one best split, and
    after step 5 nothing moves. Rank 2 is 2.5x the median (window of steps 1, 2) after step 2, 4x after
    step 3: named from step 3 on (patience 2)."""
    batches, results = _train_with_straggler(monkeypatch)
    want, _ = train_serial(CFG, batches, lr=0.1)
    for state, shares, stragglers, history in results:
        assert max_state_diff(state, want) <= TOL
        assert shares == [[8, 8, 8]] * 4 + [[11, 11, 2]] * 4
        assert stragglers == [[], [], [], [2], [2], [2], [2], [2]]
        np.testing.assert_allclose(history[-1][:, 0], [0.033, 0.033, 0.024])  # compute: rows x 3 ms x factor


def test_dp_first_decision_is_the_first_step_whose_window_no_longer_holds_step_0(monkeypatch):
    """window=1, every=1, rank 2 four times slower from step 0, on the virtual clock: step 0's window
    is step 0 itself (its time includes warm-up: no decision); after step 1 the window is step 1 alone,
    so the shares move there -- to the best split [11, 11, 2] of 24 rows at speeds (1, 1, 1/4)."""
    from minidist.parallel.balance import dp

    virtual_clock(monkeypatch, dp)
    batches = make_batches(24, 4, seed=1)
    slow = Slowdown("rank=2,factor=4,from_step=0", pace=0.003)

    def body(comm):
        return train_dp_balanced(comm, CFG, batches, slow=slow, every=1, window=1, margin=0.1).shares
    for shares in run(body, ranks=3):
        assert shares == [[8, 8, 8]] * 2 + [[11, 11, 2]] * 2
