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


# (algorithm, p, (rounds, messages, bytes sent, bytes reduced)) of the busiest rank for N = 1000 bytes,
# by hand: q = the largest power of two <= p; the fold (p > q) adds 2 rounds, 2 messages, N sent, N reduced
N = 1000
COUNTS = [
    ("recursive_doubling", 4, (2, 2, 2 * N, 2 * N)),        # log2 4 = 2 steps of the whole N
    ("recursive_doubling", 8, (3, 3, 3 * N, 3 * N)),
    ("recursive_doubling", 6, (4, 4, 3 * N, 3 * N)),        # core over q = 4 (2 steps) + the fold
    ("halving_doubling", 4, (4, 4, 1500.0, 750.0)),         # 2 log q steps, 2(q-1)/q N = 1500 sent
    ("halving_doubling", 8, (6, 6, 1750.0, 875.0)),
    ("halving_doubling", 6, (6, 6, 2500.0, 1750.0)),        # q = 4: (4, 4, 1500, 750) + the fold
    ("ring", 6, (10, 10, 2 * 5 / 6 * N, 5 / 6 * N)),        # 2(p-1) steps of N/p
    ("two_shot", 6, (2, 10, 2 * 5 / 6 * N, 5 / 6 * N)),     # the ring's bytes in two rounds
    ("ring", 2, (2, 2, 1000.0, 500.0)),
    ("halving_doubling", 2, (2, 2, 1000.0, 500.0)),         # at p = 2 the same exchange as the ring
    ("recursive_doubling", 2, (1, 1, 1000, 1000)),
    ("recursive_doubling", 3, (3, 3, 2 * N, 2 * N)),        # q = 2: 1 step + the fold
]


@pytest.mark.parametrize("algorithm, p, want", COUNTS)
def test_all_reduce_counts_table(algorithm, p, want):
    assert cost.all_reduce_counts(algorithm, N, p) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("algorithm", ["ring", "two_shot", "halving_doubling", "recursive_doubling", "shm"])
def test_one_rank_costs_nothing_and_an_unknown_algorithm_is_refused(algorithm):
    assert cost.all_reduce_counts(algorithm, N, 1) == (0, 0, 0.0, 0.0)
    assert cost.all_reduce_bytes_sent(algorithm, N, 1, 0) == 0
    assert cost.all_reduce_cost(algorithm, N, 1, 1.0, 1.0) == 0.0
    with pytest.raises(ValueError, match="no cost model for 'tree'"):
        cost.all_reduce_counts("tree", N, 4)


def test_the_model_picks_recursive_doubling_for_a_tiny_message_and_two_shot_for_a_huge_one():
    """p = 8, a core per rank (alpha 2e-5, delta 5e-6). 8 bytes: recursive doubling costs
    3 alpha + 3 delta ~ 7.5e-5 s, two-shot 2 alpha + 14 delta = 1.1e-4, halving-doubling 6 (alpha +
    delta) = 1.5e-4, the ring 14 (alpha + delta) = 3.5e-4. 1 GiB: the bandwidth terms tie the ring,
    halving-doubling and two-shot (each 1.75 N sent, 0.875 N reduced), recursive doubling sends 3 N;
    two-shot has the fewest latency terms (1.1e-4 against halving-doubling's 1.5e-4)."""
    assert cost.choose_algorithm(8, 8, False) == "recursive_doubling"
    assert cost.choose_algorithm(1 << 30, 8, False) == "two_shot"
    alpha, delta = cost.LATENCY[False]
    assert cost.all_reduce_cost("two_shot", 8, 8, alpha, delta) == pytest.approx(
        2 * alpha + 14 * delta + 14 * cost.BETA + 7 * cost.GAMMA, rel=1e-12)
    assert cost.all_reduce_cost("recursive_doubling", 8, 8, alpha, delta) == pytest.approx(
        3 * alpha + 3 * delta + 24 * cost.BETA + 24 * cost.GAMMA, rel=1e-12)
