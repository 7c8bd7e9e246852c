"""Ulysses attention, the hybrid (Ulysses inside groups, a ring across them) and their context-parallel
GPTs equal serial attention and the serial GPT (float64; the softmax sums its keys in another order,
so within 1e-12); the ledger equals each formula, beside the ring's, and the planner's; cp that does
not divide the heads is refused clearly."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist.autograd import ops
from minidist.autograd.tensor import Tensor
from minidist.comm import Mesh, all_reduce, measure, run
from minidist.nn import GPT, GPTConfig
from minidist.parallel.context.layout import shard_sequence, unshard_sequence
from minidist.parallel.context.model import context_parallel
from minidist.parallel.context.ring import packed_ring_attention
from minidist.parallel.context.ulysses import check_heads, packed_ulysses_attention, ulysses_bytes
from minidist.parallel.context.usp import packed_usp_attention, usp_bytes, usp_groups
from tests.conftest import budget

TOL = 1e-12


def _attend(comm, qkv, g, heads, layout, causal, mode="ulysses", u=None):
    cp = comm.size
    x = Tensor(shard_sequence(qkv, comm.rank, cp, layout), requires_grad=True)
    groups = usp_groups(comm, u) if mode == "hybrid" else None
    with measure(comm) as fwd:
        if mode == "ulysses":
            out = packed_ulysses_attention(x, heads, comm, layout, causal)
        elif mode == "hybrid":
            out = packed_usp_attention(x, heads, groups, layout, causal)
        else:
            out = packed_ring_attention(x, heads, comm, layout, causal)
    with measure(comm) as bwd:
        out.backward(shard_sequence(g, comm.rank, cp, layout))
    return out.data, x.grad, fwd.bytes_sent, bwd.bytes_sent


@given(cp=st.integers(1, 4), b=st.integers(1, 2), heads_per_rank=st.integers(1, 2), c=st.integers(1, 2),
       d=st.integers(1, 4), layout=st.sampled_from(["zigzag", "contiguous"]), causal=st.booleans(),
       seed=st.integers(0, 9))
@budget(15)
def test_ulysses_attention_equals_serial_attention_forward_and_gradients(cp, b, heads_per_rank, c, d, layout,
                                                                         causal, seed):
    heads, t = cp * heads_per_rank, 2 * cp * c
    rng = np.random.default_rng(seed)
    qkv, g = rng.standard_normal((b, t, 3 * heads * d)), rng.standard_normal((b, t, heads * d))
    x = Tensor(qkv.copy(), requires_grad=True)
    want = ops.packed_attention(x, heads, causal=causal)
    want.backward(g)
    res = run(_attend, ranks=cp, qkv=qkv, g=g, heads=heads, layout=layout, causal=causal)
    np.testing.assert_allclose(unshard_sequence([r[0] for r in res], layout), want.data, rtol=0, atol=TOL)
    np.testing.assert_allclose(unshard_sequence([r[1] for r in res], layout), x.grad, rtol=0, atol=TOL)
    n = b * (t // cp) * heads * d  # this rank's q elements; each all-to-all sends (cp-1)/cp of its array
    for r in res:
        assert r[2] == (cp - 1) * (3 * n + n) // cp * 8  # q|k|v out, the output back
        assert r[3] == (cp - 1) * (n + 3 * n) // cp * 8  # the output gradient out, dq|dk|dv back


@given(u_rings=st.sampled_from([(1, 2), (2, 1), (2, 2), (1, 4), (4, 1), (1, 3), (3, 1)]),
       b=st.integers(1, 2), heads_per_rank=st.integers(1, 2), c=st.integers(1, 2), d=st.integers(1, 3),
       layout=st.sampled_from(["zigzag", "contiguous"]), causal=st.booleans(), seed=st.integers(0, 9))
@budget(12)
def test_hybrid_attention_equals_serial_attention_bytes_formula(u_rings, b, heads_per_rank, c, d, layout,
                                                                causal, seed):
    """USP: Ulysses inside groups of u ranks, the ring across R groups (u = cp: Ulysses; u = 1: a ring)."""
    u, rings = u_rings
    cp, heads = u * rings, u * heads_per_rank
    t = 2 * cp * c
    rng = np.random.default_rng(seed)
    qkv, g = rng.standard_normal((b, t, 3 * heads * d)), rng.standard_normal((b, t, heads * d))
    x = Tensor(qkv.copy(), requires_grad=True)
    want = ops.packed_attention(x, heads, causal=causal)
    want.backward(g)
    res = run(_attend, ranks=cp, qkv=qkv, g=g, heads=heads, layout=layout, causal=causal, mode="hybrid", u=u)
    np.testing.assert_allclose(unshard_sequence([r[0] for r in res], layout), want.data, rtol=0, atol=TOL)
    np.testing.assert_allclose(unshard_sequence([r[1] for r in res], layout), x.grad, rtol=0, atol=TOL)
    n = b * (t // cp) * heads * d
    for r in res:
        assert {"forward": r[2], "backward": r[3]} == usp_bytes(n, 8, u, rings)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("t", [8, 16, 32])
def test_ring_and_ulysses_bytes_per_rank_ledger_equals_formula(cp, t):
    """The table of the chapter: bytes per rank, measured, against both formulas; Ulysses sends less
    at every cp >= 2 (ring: 2(cp-1)·N forward, (4cp-2)·N backward; Ulysses: 4(cp-1)/cp·N each way)."""
    b, heads, d = 1, 4, 2
    rng = np.random.default_rng(0)
    qkv, g = rng.standard_normal((b, t, 3 * heads * d)), rng.standard_normal((b, t, heads * d))
    n = b * heads * (t // cp) * d
    ring = run(_attend, ranks=cp, qkv=qkv, g=g, heads=heads, layout="zigzag", causal=True, mode="ring")
    uly = run(_attend, ranks=cp, qkv=qkv, g=g, heads=heads, layout="zigzag", causal=True)
    for r, u in zip(ring, uly):
        assert (r[2], r[3]) == (2 * (cp - 1) * n * 8, (4 * cp - 2) * n * 8)
        assert (u[2], u[3]) == (4 * (cp - 1) * n // cp * 8,) * 2
        assert ulysses_bytes(n, 8, cp) == {"forward": u[2], "backward": u[3]}
        assert u[2] + u[3] < r[2] + r[3]


CFG = GPTConfig(vocab_size=16, block_size=16, n_layer=2, n_head=4, d_model=16, dtype="float64")


def _cp_gpt(comm, x, y, cp, tp, layout, mode="ulysses", u=None):
    from minidist.parallel.tensor.sharding import sharding_table, unshard
    from minidist.parallel.three_d import build_model

    mesh = Mesh(comm, cp=cp, tp=tp)
    model, loss_fn = build_model(CFG, mesh.tp)
    context_parallel(model, mesh.cp, layout, mode=mode, ulysses_size=u)
    xs, ys = (shard_sequence(a, mesh.cp_rank, cp, layout) for a in (x, y))
    n_all, n_mine = int((y != -1).sum()), int((ys != -1).sum())
    loss = (loss_fn or ops.cross_entropy)(model(xs), ys) * (n_mine / n_all)  # my tokens' share of the mean
    loss.backward()
    total = float(all_reduce(mesh.cp, np.array([float(loss.data)]))[0])
    grads = {k: all_reduce(mesh.cp, p.grad) for k, p in model.named_parameters()}  # token partial sums
    if tp > 1:
        grads = unshard(mesh.tp.allgather_obj(grads), sharding_table(model))
    return total, grads


@pytest.mark.parametrize("cp,tp,layout,mode,u", [(2, 1, "zigzag", "ulysses", None),
                                                 (4, 1, "contiguous", "ulysses", None),
                                                 (2, 2, "zigzag", "ulysses", None),
                                                 (4, 1, "zigzag", "hybrid", 2),
                                                 (2, 2, "contiguous", "hybrid", 1)])
def test_ulysses_context_parallel_gpt_equals_serial_gpt(cp, tp, layout, mode, u):
    """Heads split over tp x cp in the (2, 2) case: 4 heads, one per rank during attention; hybrid:
    Ulysses over u ranks, a ring across cp/u groups."""
    rng = np.random.default_rng(1)
    x = rng.integers(0, 16, (2, 16))
    y = np.where(rng.random((2, 16)) < 0.2, -1, rng.integers(0, 16, (2, 16)))
    serial = GPT(CFG)
    want_loss = serial.loss(x, y)
    want_loss.backward()
    want = {k: p.grad for k, p in serial.named_parameters()}
    for loss, grads in run(_cp_gpt, ranks=cp * tp, x=x, y=y, cp=cp, tp=tp, layout=layout, mode=mode, u=u):
        assert abs(loss - float(want_loss.data)) <= TOL
        assert grads.keys() == want.keys()
        for k in want:
            np.testing.assert_allclose(grads[k], want[k], rtol=0, atol=TOL, err_msg=k)


def test_cp_that_does_not_divide_the_heads_is_refused_before_any_collective():
    assert check_heads(4, 2) == 2
    with pytest.raises(ValueError, match=r"splits the 2 attention heads .* over cp = 4 .*cp in \[1, 2\]"):
        check_heads(2, 4)
    with pytest.raises(ValueError, match=r"rank 0: Ulysses .* 6 attention heads .* cp = 4 .*\[1, 2, 3, 6\]"):
        check_heads(6, 4)
    cfg = CFG.replace(n_head=2, d_model=8)
    with pytest.raises(ValueError, match=r"splits the 2 attention heads of a rank over cp = 4"):
        run(lambda comm: context_parallel(GPT(cfg), comm, mode="ulysses"), ranks=4)
    with pytest.raises(ValueError, match=r"mode='hybird'; use one of \('ring', 'ulysses', 'hybrid'\)"):
        run(lambda comm: context_parallel(GPT(cfg), comm, mode="hybird"), ranks=1)
    with pytest.raises(ValueError, match=r"cp = 4 ranks by ulysses_size = 3; it must divide cp \(one of"):
        run(lambda comm: context_parallel(GPT(CFG.replace(n_head=3, d_model=12)), comm, mode="hybrid",
                                          ulysses_size=3), ranks=4)
    with pytest.raises(ValueError, match=r"mode='hybrid' needs ulysses_size="):
        run(lambda comm: context_parallel(GPT(cfg), comm, mode="hybrid"), ranks=2)


def test_lesson_cp_mode_passes_and_is_refused_when_cp_does_not_fit_its_heads(capsys):
    from minidist.lessons import long_context

    with pytest.raises(SystemExit) as e:
        long_context.main(["--ranks", "3", "--seq", "12", "--cp-mode", "ulysses"])
    assert e.value.code == 2
    assert "error: argument --cp-mode: ulysses splits the GPT's 4 attention heads over cp = 3" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        long_context.main(["--ranks", "3", "--seq", "12", "--cp-mode", "hybrid"])
    assert e.value.code == 2 and "hybrid groups the ranks in pairs" in capsys.readouterr().err
    long_context.main(["--ranks", "2", "--seq", "8", "--cp-mode", "ulysses"])
    out = capsys.readouterr().out
    assert "5b. ulysses" in out and "FAIL" not in out


def _attention_traffic(comm, x, mode):
    """One forward + backward of the cp GPT: this rank's bytes sent (attention is its only traffic)."""
    model = context_parallel(GPT(CFG), comm, mode=mode)
    xs = shard_sequence(x, comm.rank, comm.size)
    with measure(comm) as m:
        ops.cross_entropy(model(xs), xs).backward()
    return m.bytes_sent


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
@pytest.mark.parametrize("cp", [2, 4])
def test_planner_prices_ring_and_ulysses_as_the_ledger_counts(mode, cp):
    from minidist.plan.mesh import Candidate
    from minidist.plan.model import ModelSpec
    from minidist.plan.traffic import bytes_by_axis, collectives

    x = np.random.default_rng(0).integers(0, 16, (2, 16))
    spec = ModelSpec.of_gpt("cfg", CFG).replace(dtype_bytes=8)  # float64, as CFG
    planned = bytes_by_axis(collectives(spec, Candidate(cp=cp, microbatch_size=2), batch=2,
                                        cp_mode=mode))["cp"]
    for sent in run(_attention_traffic, ranks=cp, x=x, mode=mode):
        assert sent == planned


def test_ulysses_takes_as_many_ranks_as_heads_one_head_each():
    """cp = heads is the largest Ulysses split (one head per rank), not an error; one rank more is."""
    assert check_heads(4, 4) == 1 and check_heads(1, 1) == 1
    with pytest.raises(ValueError, match="cp must divide them"):
        check_heads(4, 8)
