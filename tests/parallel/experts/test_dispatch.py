"""Expert parallelism equals the serial MoE on each rank's tokens (same routing, same drops), and its
all-to-all bytes equal the formula written out here."""

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from minidist.autograd.tensor import Tensor
from minidist.comm import Mesh, all_reduce, measure, run
from minidist.nn.moe import MoE
from minidist.parallel.experts.dispatch import ExpertParallelMoE
from tests.conftest import budget

D, H = 3, 5


def _serial(xs, gs, e, k, cf, seed):
    """The serial MoE applied to each rank's tokens separately; gradients summed over them."""
    moe = MoE(D, e, k, cf, hidden=H, dtype=np.float64, std=0.5, rng=np.random.default_rng(seed))
    outs, stats = [], []
    for x in xs:
        y = moe(Tensor(x))
        outs.append(y)
        stats.append(moe.stats)
    loss = sum((y * Tensor(g)).sum() for y, g in zip(outs, gs)) + \
        sum(s.aux_loss * 0.1 + s.z_loss * 0.01 for s in stats)
    loss.backward()
    return [y.data for y in outs], {n: p.grad for n, p in moe.named_parameters()}, stats


def _ep_rank(comm, xs, gs, e, k, cf, seed, ep):
    mesh = Mesh(comm, dp=comm.size, ep=ep)                       # ep carved from dp
    moe = ExpertParallelMoE(D, e, mesh.ep, k, cf, hidden=H, dtype=np.float64, std=0.5,
                            rng=np.random.default_rng(seed))
    x = Tensor(xs[comm.rank], requires_grad=True)                # as in a model: the input wants a gradient
    with measure(mesh.ep) as fwd:
        y = moe(x)
    loss = (y * Tensor(gs[comm.rank])).sum() + moe.stats.aux_loss * 0.1 + moe.stats.z_loss * 0.01
    with measure(mesh.ep) as bwd:
        loss.backward()
    grads = {}
    for n, p in moe.named_parameters():  # the router is replicated: its gradient sums over every rank
        grads[moe.global_name(n)] = all_reduce(comm, p.grad) if n.startswith("router") else \
            all_reduce(mesh.edp, p.grad)
    return y.data, grads, moe.stats, fwd.bytes_sent, bwd.bytes_sent, fwd.calls


@given(dp=st.sampled_from([2, 4]), ep=st.sampled_from([1, 2, 4]), per=st.integers(1, 3),
       k=st.integers(1, 2), n=st.integers(1, 7), cf=st.sampled_from([0.5, 1.0, 1.5]), seed=st.integers(0, 50))
@budget(10)
@example(dp=4, ep=4, per=1, k=2, n=6, cf=0.5, seed=0)
@example(dp=4, ep=2, per=2, k=1, n=5, cf=1.0, seed=1)
def test_expert_parallel_equals_serial_moe_on_each_ranks_tokens(dp, ep, per, k, n, cf, seed):
    if dp % ep:
        ep = dp
    e = ep * per
    k = min(k, e)
    rng = np.random.default_rng(seed)
    xs, gs = rng.standard_normal((dp, n, D)), rng.standard_normal((dp, n, D))
    want_y, want_g, want_stats = _serial(xs, gs, e, k, cf, seed)
    out = run(_ep_rank, ranks=dp, xs=xs, gs=gs, e=e, k=k, cf=cf, seed=seed, ep=ep)
    grads = {}
    for r, (y, g, stats, fwd, bwd, calls) in enumerate(out):
        np.testing.assert_allclose(y, want_y[r], rtol=0, atol=1e-12)
        assert stats.tokens_per_expert.tolist() == want_stats[r].tokens_per_expert.tolist()
        assert stats.kept_per_expert.tolist() == want_stats[r].kept_per_expert.tolist()
        grads.update(g)
        # the formula: each all-to-all sends ep-1 blocks of (E/ep)·C·D float64s; two forward, two backward
        cap = max(1, int(np.ceil(cf * k * n / e)))  # slots per expert, from this rank's n tokens
        block = (e // ep) * cap * D * 8
        assert fwd == 2 * (ep - 1) * block and bwd == 2 * (ep - 1) * block
        assert [c.name for c in calls] == ["all_to_all", "all_to_all"]
    assert grads.keys() == want_g.keys()
    for name in want_g:  # experts: summed over the edp ranks holding the same experts
        np.testing.assert_allclose(grads[name], want_g[name], rtol=0, atol=1e-12, err_msg=name)


def _check_uneven(ns, ep, e, k, cf, seed):
    """Each rank r holds ns[r] tokens; the expert-parallel run equals the serial MoE on each
    rank's tokens (its own capacity C_r), outputs and every gradient."""
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal((n, D)) for n in ns]
    gs = [rng.standard_normal((n, D)) for n in ns]
    want_y, want_g, want_stats = _serial(xs, gs, e, k, cf, seed)
    out = run(_ep_rank, ranks=len(ns), xs=xs, gs=gs, e=e, k=k, cf=cf, seed=seed, ep=ep)
    grads = {}
    for r, (y, g, stats, fwd, bwd, _) in enumerate(out):
        assert y.shape == (ns[r], D)
        np.testing.assert_allclose(y, want_y[r], rtol=0, atol=1e-12)
        assert stats.capacity == want_stats[r].capacity == max(1, int(np.ceil(cf * k * ns[r] / e)))
        assert stats.kept_per_expert.tolist() == want_stats[r].kept_per_expert.tolist()
        # this rank sends ep-1 blocks of (E/ep)·C_r rows out and ep-1 blocks of its peers' C back
        group = [q for q in range(len(ns)) if q // ep == r // ep]  # ep groups: consecutive ranks
        caps = {q: max(1, int(np.ceil(cf * k * ns[q] / e))) for q in group}
        back = sum(caps[q] for q in group if q != r)
        assert fwd == (e // ep) * D * 8 * ((ep - 1) * caps[r] + back) == bwd
        grads.update(g)
    assert grads.keys() == want_g.keys()
    for name in want_g:
        np.testing.assert_allclose(grads[name], want_g[name], rtol=0, atol=1e-12, err_msg=name)


def test_expert_parallel_with_uneven_tokens_per_rank_equals_serial():
    """The case that died in np.stack: dp = ep = 2, E = 4, top-2, capacity factor 1.0, 12 and 8
    tokens (capacities 6 and 4)."""
    _check_uneven([12, 8], ep=2, e=4, k=2, cf=1.0, seed=0)


@given(ns=st.lists(st.integers(1, 9), min_size=2, max_size=4).filter(lambda v: len(v) != 3),
       ep=st.sampled_from([2, 4]), per=st.integers(1, 2), k=st.integers(1, 2),
       cf=st.sampled_from([0.5, 1.0, 1.5]), seed=st.integers(0, 50))
@budget(10)
def test_expert_parallel_with_any_tokens_per_rank_equals_serial(ns, ep, per, k, cf, seed):
    ep = min(ep, len(ns))
    _check_uneven(ns, ep=ep, e=ep * per, k=min(k, ep * per), cf=cf, seed=seed)


def test_experts_must_divide_over_ep():
    with pytest.raises(ValueError, match=r"n_experts=3 is not divisible by the expert-parallel size ep=2; "
                                         r"use ep in \[1, 3\]"):
        run(lambda comm: ExpertParallelMoE(D, 3, comm), ranks=2)


def test_lesson_passes_and_exits_1_when_the_exchange_is_wrong(monkeypatch, capsys):
    from minidist.lessons import moe as lesson
    from minidist.parallel.experts import dispatch as experts

    argv = ["--ranks", "2", "--tokens", "64"]
    lesson.main(argv)
    out = capsys.readouterr().out
    assert out.count("PASS") == 3 and "FAIL" not in out
    good = experts._exchange
    monkeypatch.setattr(experts, "_exchange",  # blocks misrouted
                        lambda comm, x, *a: good(comm, x, *a)[::-1].copy())
    with pytest.raises(SystemExit) as e:
        lesson.main(argv)
    assert e.value.code == 1 and "FAIL" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        lesson.main(["--ranks", "2", "--experts", "3"])
    assert e.value.code == 2


@pytest.mark.parametrize("backend", ["numpy", "jax"])
def test_exchange_transposes_rows_over_ranks_and_compiles_nothing_on_jax(backend):
    """``_exchange``: rank r's row j goes to rank j, as row r there. A device array goes through
    the host once each way (all_to_all stages through it anyway): on JAX no program at all."""
    if backend == "jax":
        pytest.importorskip("jax")
    from minidist.accel import jax_engine
    from minidist.parallel.experts.dispatch import _exchange

    p = 3

    def body(comm):
        x = np.arange(p * 2 * 4, dtype=np.float32).reshape(p, 2, 4) + 100 * comm.rank
        before = jax_engine.compilations() if backend == "jax" else 0
        y = _exchange(comm, comm.backend.from_host(x))
        programs = jax_engine.compilations() - before if backend == "jax" else 0
        return np.asarray(comm.backend.to_host(y)), type(y) is np.ndarray, programs

    out = run(body, ranks=p, backend=backend)
    for r, (y, on_host, programs) in enumerate(out):
        want = np.stack([np.arange(p * 2 * 4, dtype=np.float32).reshape(p, 2, 4)[r] + 100 * j
                         for j in range(p)])
        np.testing.assert_array_equal(y, want)
        assert on_host == (backend == "numpy") and programs == 0


def test_exchange_moves_blocks_of_several_rows_and_refuses_uneven_blocks():
    """Rows (p·m, d) are p blocks of m rows: block j of rank r lands as block r on rank j. Rows that
    don't cut into p equal blocks are refused, naming the rank and the rule."""
    from minidist.parallel.experts.dispatch import _exchange

    p, m, d = 3, 2, 4

    def body(comm):
        x = np.arange(p * m * d, dtype=np.float64).reshape(p * m, d) + 1000 * comm.rank
        return _exchange(comm, x)

    for r, y in enumerate(run(body, ranks=p)):
        base = np.arange(p * m * d, dtype=np.float64).reshape(p * m, d)
        want = np.concatenate([base[r * m:(r + 1) * m] + 1000 * j for j in range(p)])
        np.testing.assert_array_equal(y, want)
    with pytest.raises(ValueError, match=r"rank \d: .*7 rows into 3 equal blocks"):
        run(lambda comm: _exchange(comm, np.zeros((7, 2))), ranks=3)
