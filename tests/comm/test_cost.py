"""The all-reduce cost model (``minidist.comm.cost``) at its boundaries, by hand: where the shm
all-reduce turns two-shot, where shm stops winning, which ranks of a non-power-of-two group fold,
and the alpha-beta-gamma-delta sum -- every expected number written out here."""

import pytest

from minidist.comm import cost


def test_shm_two_shot_starts_at_its_threshold_inclusive():
    t = cost.shm_two_shot_from(4)
    assert t == 512 << 10
    assert cost.shm_two_shot(t, 4) and not cost.shm_two_shot(t - 1, 4)
    assert not cost.shm_two_shot(1 << 40, 2)  # two ranks: one-shot at any size
    # the counts follow the same boundary: two waits and (p-1)/p·N reduced from the threshold on
    assert cost.all_reduce_counts("shm", t, 4) == (2, 1, t + t / 4, 3 / 4 * t)
    assert cost.all_reduce_counts("shm", t - 4, 4) == (1, 1, t - 4, 3 * (t - 4))


def test_shm_wins_up_to_one_window_inclusive_and_at_any_size_when_crowded():
    w = 4 << 20
    assert cost.shm_wins(w, w, False) and not cost.shm_wins(w + 1, w, False)
    assert cost.shm_wins(1 << 30, w, True)
    assert cost.auto_algorithm(w, 4, False, shared_memory=True, window=w) == "shm"
    assert cost.auto_algorithm(w, 4, False, shared_memory=False, window=w) != "shm"


@pytest.mark.parametrize("algorithm", ["recursive_doubling", "halving_doubling"])
def test_the_fold_of_six_ranks_pairs_ranks_0_to_3_and_leaves_4_and_5_in_the_core(algorithm):
    """p = 6, q = 4, rem = 2: ranks 0..3 fold in pairs (0 sends its N to 1 and sits out; 1 runs the
    core over q = 4 and sends the result back to 0), ranks 4 and 5 only run the core."""
    n = 4096
    core = {"recursive_doubling": 2 * n, "halving_doubling": 2 * 3 / 4 * n}[algorithm]  # over q = 4
    got = [cost.all_reduce_bytes_sent(algorithm, n, 6, r) for r in range(6)]
    assert got == [n, core + n, n, core + n, core, core]


def test_ring_counts_and_cost_are_the_textbook_sum():
    """Ring over p = 4 of N = 4000 bytes: 2(p-1) = 6 rounds and messages, 2(p-1)/p·N = 6000 bytes
    sent, half of that reduced; the cost adds rounds·alpha + messages·delta + bytes·beta + reduced·gamma."""
    assert cost.all_reduce_counts("ring", 4000, 4) == (6, 6, 6000.0, 3000.0)
    alpha, delta = 1e-3, 1e-4
    want = 6 * alpha + 6 * delta + 6000 * cost.BETA + 3000 * cost.GAMMA
    assert cost.all_reduce_cost("ring", 4000, 4, alpha, delta) == pytest.approx(want, rel=1e-12)
    # delta alone: the per-message term is counted
    assert cost.all_reduce_cost("ring", 4000, 4, 0.0, 1.0) - cost.all_reduce_cost("ring", 4000, 4, 0.0, 0.0) \
        == pytest.approx(6.0)
    assert cost.all_reduce_counts("two_shot", 4000, 4) == (2, 6, 6000.0, 3000.0)
