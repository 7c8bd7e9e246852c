"""The ledger equals the textbook formulas, exactly."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minidist.comm import (
    Mesh,
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    gather,
    measure,
    recursive_doubling_all_reduce,
    reduce_scatter,
    ring_all_reduce,
    run,
    scatter,
    tree_all_reduce,
)

FAST = settings(max_examples=15, deadline=None, derandomize=True)


def measured(p, fn):
    def body(comm):
        with measure(comm) as m:
            fn(comm)
        return m
    return run(body, ranks=p)


@FAST
@given(p=st.integers(2, 8), k=st.integers(1, 50), dtype=st.sampled_from(["float32", "float64", "int16"]))
def test_ring_all_reduce_sends_2_p_minus_1_over_p_N_in_2_p_minus_1_steps(p, k, dtype):
    x = np.ones(p * k, dtype)  # N divisible by p
    N = x.nbytes
    for m in measured(p, lambda comm: ring_all_reduce(comm, x)):
        assert m.bytes_sent == 2 * (p - 1) * N // p == m.bytes_received
        assert m.steps == 2 * (p - 1)
        assert m.messages == 2 * (p - 1)
        assert [c.name for c in m.calls] == ["ring_all_reduce"]
        assert m.calls[0].bytes == m.bytes_sent and m.calls[0].steps == m.steps


@FAST
@given(p=st.integers(2, 8), n=st.integers(0, 40))
def test_ring_uneven_chunks_formula(p, n):
    """Rank r sends every chunk but r (reduce-scatter) and every chunk but r+1 (all-gather)."""
    x = np.ones(n, np.float32)
    sizes = [c.nbytes for c in np.array_split(x, p)]
    for r, m in enumerate(measured(p, lambda comm: ring_all_reduce(comm, x))):
        assert m.bytes_sent == 2 * x.nbytes - sizes[r] - sizes[(r + 1) % p]


@FAST
@given(p=st.integers(2, 8), k=st.integers(1, 30))
def test_reduce_scatter_and_all_gather_send_p_minus_1_over_p_N(p, k):
    x = np.ones((p * k, 3), np.float64)
    N = x.nbytes
    for m in measured(p, lambda comm: reduce_scatter(comm, x)):
        assert m.bytes_sent == (p - 1) * N // p and m.steps == p - 1
    piece = np.ones((k, 3), np.float64)  # all-gather output is N bytes
    for m in measured(p, lambda comm: all_gather(comm, piece)):
        assert m.bytes_sent == (p - 1) * N // p and m.steps == p - 1
        assert m.header_bytes > 0  # shapes were learned from headers, not counted as payload
    for m in measured(p, lambda comm: all_gather(comm, piece, sizes="equal")):
        assert m.bytes_sent == (p - 1) * N // p and m.steps == p - 1
        assert m.header_bytes == 0  # every rank knew the sizes: raw buffers only


@FAST
@given(p=st.integers(2, 8), n=st.integers(0, 40))
def test_all_gather_known_uneven_sizes_formula(p, n):
    """Rank r sends every part but r+1's (the last one it receives): N - |part r+1| bytes."""
    from minidist.comm import split_sizes

    sizes = split_sizes(n, p)
    assert sizes == [len(a) for a in np.array_split(np.empty(n), p)]
    for r, m in enumerate(measured(p, lambda comm: all_gather(comm, np.ones(sizes[comm.rank], np.float32),
                                                              sizes=sizes))):
        assert m.bytes_sent == 4 * (n - sizes[(r + 1) % p]) and m.header_bytes == 0


@FAST
@given(p=st.integers(2, 8))
def test_latency_algorithms_take_log_p_steps(p):
    x = np.ones(10, np.float32)
    log2p = (p - 1).bit_length()
    pow2 = p & (p - 1) == 0
    for m in measured(p, lambda comm: recursive_doubling_all_reduce(comm, x)):
        assert m.steps == (log2p if pow2 else (p.bit_length() - 1) + 2)
        if pow2:
            assert m.bytes_sent == log2p * x.nbytes
    for m in measured(p, lambda comm: tree_all_reduce(comm, x)):
        assert m.steps == 2 * log2p


@FAST
@given(p=st.integers(2, 8), k=st.integers(1, 20))
def test_halving_doubling_moves_ring_bytes_in_2_log_p_steps(p, k):
    from minidist.comm import halving_doubling_all_reduce

    q = 1 << (p.bit_length() - 1)
    x = np.ones(q * k, np.float64)
    for r, m in enumerate(measured(p, lambda comm: halving_doubling_all_reduce(comm, x))):
        log2q = q.bit_length() - 1
        assert m.steps == 2 * log2q + (2 if p > q else 0)
        folded = r < 2 * (p - q)
        if not folded:
            assert m.bytes_sent == 2 * (q - 1) * x.nbytes // q
        elif r % 2 == 0:
            assert m.bytes_sent == x.nbytes  # hands its array over and sits out


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
def test_two_shot_sends_the_rings_bytes_in_two_rounds(p):
    from minidist.comm import two_shot_all_reduce

    x = np.ones(p * 1000, np.float32)
    for m in measured(p, lambda comm: two_shot_all_reduce(comm, x)):
        assert m.bytes_sent == 2 * (p - 1) * x.nbytes // p and m.messages == 2 * (p - 1)
        assert m.steps == (2 if p > 1 else 0)  # one rank: nothing to exchange, no rounds


@pytest.mark.parametrize("algo", ["ring", "recursive_doubling", "halving_doubling", "two_shot", "tree",
                                  "naive", "auto"])
def test_one_rank_sends_nothing_in_zero_steps(algo):
    (m,) = measured(1, lambda comm: all_reduce(comm, np.ones(5), algorithm=algo))
    assert (m.bytes_sent, m.messages, m.steps) == (0, 0, 0)


@FAST
@given(p=st.integers(1, 8), seed=st.integers(0, 99))
def test_all_to_all_sends_every_chunk_but_its_own_in_p_minus_1_steps(p, seed):
    sizes = np.random.default_rng(seed).integers(0, 6, size=(p, p))  # sizes[i, j]: rank i -> rank j
    chunks = [[np.ones(sizes[i, j], np.float64) for j in range(p)] for i in range(p)]
    for r, m in enumerate(measured(p, lambda comm: all_to_all(comm, chunks[comm.rank]))):
        assert m.bytes_sent == 8 * (sizes[r].sum() - sizes[r, r])
        assert m.bytes_received == 8 * (sizes[:, r].sum() - sizes[r, r])
        assert m.messages == m.steps == p - 1


@FAST
@given(p=st.integers(1, 8), n=st.integers(0, 30), data=st.data())
def test_gather_and_scatter_move_p_minus_1_parts_through_the_root(p, n, data):
    """Gather: every other rank sends its part (N_r bytes) to the root; scatter: the root sends
    every part but its own. p-1 steps (the root's messages, one per other rank)."""
    root = data.draw(st.integers(0, p - 1))
    parts = [np.ones(n + r, np.int32) for r in range(p)]  # parts of different sizes
    others = sum(x.nbytes for x in parts) - parts[root].nbytes
    for r, m in enumerate(measured(p, lambda comm: gather(comm, parts[comm.rank], root=root))):
        assert m.bytes_sent == (0 if r == root else parts[r].nbytes) and m.steps == p - 1
        assert m.bytes_received == (others if r == root else 0)
    for r, m in enumerate(measured(p, lambda comm: scatter(comm, parts if comm.rank == root else None,
                                                           root=root))):
        assert m.bytes_sent == (others if r == root else 0) and m.steps == p - 1
        assert m.bytes_received == (0 if r == root else parts[r].nbytes)


def binomial_children(vr: int, p: int) -> int:
    """Ranks that rank vr (relative to the root) forwards to in a binomial-tree broadcast: vr + 2**k
    for every 2**k below vr's lowest set bit (any 2**k < p at the root), if that rank exists."""
    low = vr & -vr if vr else p
    return sum(1 for k in range(p.bit_length()) if 1 << k < low and vr + (1 << k) < p)


@FAST
@given(p=st.integers(1, 8), n=st.integers(0, 30), data=st.data())
def test_tree_broadcast_sends_N_per_child(p, n, data):
    """Binomial tree: the root sends N to ceil(log2 p) children, every rank N per child; (p-1)·N in
    all (every rank but the root receives N once), in ceil(log2 p) steps."""
    root = data.draw(st.integers(0, p - 1))
    x = np.ones(n, np.float32)
    ms = measured(p, lambda comm: broadcast(comm, x if comm.rank == root else None, root=root))
    log2p = (p - 1).bit_length()
    for r, m in enumerate(ms):
        assert m.bytes_sent == binomial_children((r - root) % p, p) * x.nbytes and m.steps == log2p
        assert m.bytes_received == (0 if r == root else x.nbytes)
    assert ms[root].bytes_sent == log2p * x.nbytes
    assert sum(m.bytes_sent for m in ms) == (p - 1) * x.nbytes


@pytest.mark.parametrize("p", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("crowded", [False, True])
def test_auto_follows_the_cost_model(p, crowded, monkeypatch):
    """auto runs what the alpha-beta model predicts fastest: recursive doubling (fewest rounds) for
    small messages at p = 2^k, an algorithm sending the ring's 2(p-1)/p·N bytes for large ones."""
    from minidist.comm import cost

    monkeypatch.setattr(cost, "crowded", lambda: crowded)
    cost.choose_algorithm.cache_clear()
    n = 3 << 18  # 3 MB of float32, divisible by every p here: the formulas are exact
    small, large = cost.choose_algorithm(40, p), cost.choose_algorithm(4 * n, p)
    if p & (p - 1) == 0:
        assert small == "recursive_doubling"
    assert large in ("ring", "halving_doubling", "two_shot")

    def body(comm):
        with measure(comm) as m:
            all_reduce(comm, np.ones(10, np.float32))
            all_reduce(comm, np.ones(n, np.float32))
        return [c.name for c in m.calls], m.calls[1]
    try:
        for names, big in run(body, ranks=p):
            assert names == [f"{small}_all_reduce", f"{large}_all_reduce"]
            assert big.bytes_sent == 2 * (p - 1) * 4 * n // p
    finally:
        cost.choose_algorithm.cache_clear()


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6])
def test_cost_all_reduce_bytes_sent_equals_the_ledger_on_every_rank(p):
    """``cost.all_reduce_bytes_sent`` (what lessons print as the formula) == what the ledger counts,
    per algorithm and rank, the fold of non-powers of two included. 120 float32: p divides it."""
    from minidist.comm.cost import all_reduce_bytes_sent

    algos = ("ring", "two_shot", "recursive_doubling", "halving_doubling")

    def body(comm):
        out = []
        for a in algos:
            with measure(comm) as m:
                all_reduce(comm, np.ones(120, np.float32), algorithm=a)
            out.append(([c.name for c in m.calls], m.bytes_sent))
        return out

    for r, res in enumerate(run(body, ranks=p)):
        for a, (names, sent) in zip(algos, res):
            assert names == [f"{a}_all_reduce"]
            assert all_reduce_bytes_sent(a, 480, p, r) == sent, (a, p, r)


def test_cost_model_orders_algorithms_as_the_textbook():
    from minidist.comm.cost import LATENCY, all_reduce_cost

    alpha, delta = LATENCY[False]
    tiny, huge = 1024, 1 << 30
    for p in (4, 8, 16):  # tiny: fewest rounds wins; huge: fewest bytes (log2 p·N loses)
        costs = {a: all_reduce_cost(a, tiny, p, alpha, delta)
                 for a in ("ring", "recursive_doubling", "halving_doubling", "two_shot")}
        assert min(costs, key=costs.get) == "recursive_doubling"
        assert all_reduce_cost("recursive_doubling", huge, p, alpha, delta) > \
            all_reduce_cost("ring", huge, p, alpha, delta)
        assert all_reduce_cost("ring", tiny, p, alpha, delta) > all_reduce_cost("halving_doubling", tiny, p,
                                                                                alpha, delta)


def test_subgroup_traffic_counts_in_the_group_and_the_world():
    def body(comm):
        mesh = Mesh(comm, dp=2, tp=2)
        with measure(comm) as world, measure(mesh.tp) as tp, measure(mesh.dp) as dp:
            ring_all_reduce(mesh.tp, np.ones(8, np.float32))
        return world.bytes_sent, tp.bytes_sent, dp.bytes_sent
    for w, t, d in run(body, ranks=4):
        assert w == t == 2 * 1 * 32 // 2 and d == 0
