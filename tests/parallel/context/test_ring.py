"""Ring attention and context parallelism equal serial attention and the serial GPT (float64)."""

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from minidist.autograd import ops
from minidist.autograd.tensor import Tensor
from minidist.comm import measure, run
from minidist.nn import GPT, GPTConfig
from minidist.nn.footprint import MemoryAccountant
from minidist.parallel.context.model import context_parallel
from minidist.parallel.context.ring import (
    AttentionStats,
    chunk_positions,
    packed_ring_attention,
    ring_attention,
    shard_sequence,
    unshard_sequence,
)
from tests.conftest import budget

TOL = 1e-12


def _serial(q, k, v, g, causal):
    ts = [Tensor(a.copy(), requires_grad=True) for a in (q, k, v)]
    out = ops.scaled_dot_product_attention(*ts, causal=causal)
    (out * Tensor(g)).sum().backward()
    return out.data, [t.grad for t in ts]


def _ring(comm, q, k, v, g, layout, causal):
    cp = comm.size
    ts = [Tensor(shard_sequence(a, comm.rank, cp, layout, axis=2), requires_grad=True) for a in (q, k, v)]
    stats = AttentionStats()
    with measure(comm) as fwd:
        out = ring_attention(*ts, comm, layout, causal=causal, stats=stats)
    with measure(comm) as bwd:
        (out * Tensor(shard_sequence(g, comm.rank, cp, layout, axis=2))).sum().backward()
    return out.data, [t.grad for t in ts], stats, fwd.bytes_sent, bwd.bytes_sent


@given(cp=st.sampled_from([1, 2, 3, 4]), b=st.integers(1, 2), h=st.integers(1, 2), c=st.integers(1, 3),
       d=st.integers(1, 4), layout=st.sampled_from(["zigzag", "contiguous"]), causal=st.booleans(),
       seed=st.integers(0, 9))
@budget(12)
@example(cp=4, b=2, h=2, c=2, d=4, layout="zigzag", causal=True, seed=0)
def test_ring_attention_equals_serial_attention_forward_and_gradients(cp, b, h, c, d, layout, causal, seed):
    t = 2 * cp * c
    rng = np.random.default_rng(seed)
    q, k, v, g = (rng.standard_normal((b, h, t, d)) for _ in range(4))
    want, want_grads = _serial(q, k, v, g, causal)
    out = run(_ring, ranks=cp, q=q, k=k, v=v, g=g, layout=layout, causal=causal)
    np.testing.assert_allclose(unshard_sequence([o[0] for o in out], layout, axis=2), want, rtol=0, atol=TOL)
    for i, w in enumerate(want_grads):
        got = unshard_sequence([o[1][i] for o in out], layout, axis=2)
        np.testing.assert_allclose(got, w, rtol=0, atol=TOL)
    # ledger == the formula: K and V (n elements each) hop cp-1 times forward; backward they hop
    # cp-1 times again and dK, dV hop cp times (back to their owner); 8 bytes per float64
    n = b * h * (t // cp) * d
    for o in out:
        assert o[3] == (cp - 1) * 2 * n * 8
        assert o[4] == ((cp - 1) * 2 * n + cp * 2 * n) * 8 if cp > 1 else o[4] == 0


def _ring_on_device(comm, q, k, v, g, layout):
    """Ring attention forward and backward on the rank's own backend; programs compiled meanwhile."""
    from minidist.accel import jax_engine

    be, cp = comm.backend, comm.size
    ts = [Tensor(be.from_host(shard_sequence(a, comm.rank, cp, layout, axis=2)), requires_grad=True)
          for a in (q, k, v)]
    comm.barrier()
    before = jax_engine.compilations()
    out = ring_attention(*ts, comm, layout)
    out.backward(be.from_host(shard_sequence(g, comm.rank, cp, layout, axis=2)))
    comm.barrier()
    grads = [be.to_host(t.grad) for t in ts]
    return be.to_host(out.data), grads, jax_engine.compilations() - before


@pytest.mark.parametrize("cp", [2, 3])
def test_ring_attention_on_jax_equals_serial_and_compiles_a_few_programs(cp):
    """On JAX each ring step's compute is one compiled call (``compiled.pure``) whose program
    depends only on the shapes and the step's chunk pairs -- under zig-zag the rank's own block, an
    earlier rank's or a later rank's -- not on the rank or the step. So one forward and backward need
    at most 9 programs per device whatever cp is: the (at most) three step patterns each way, the
    forward's results, the backward's inputs and its gradients; and the results are the serial
    attention's."""
    pytest.importorskip("jax")
    b, h, t, d, layout = 1, 2, 4 * cp, 3, "zigzag"
    rng = np.random.default_rng(cp)
    q, k, v, g = (rng.standard_normal((b, h, t, d)) for _ in range(4))
    want, want_grads = _serial(q, k, v, g, causal=True)
    out = run(_ring_on_device, ranks=cp, backend="jax", q=q, k=k, v=v, g=g, layout=layout)
    np.testing.assert_allclose(unshard_sequence([o[0] for o in out], layout, axis=2), want, rtol=0, atol=TOL)
    for i, w in enumerate(want_grads):
        np.testing.assert_allclose(unshard_sequence([o[1][i] for o in out], layout, axis=2), w, rtol=0,
                                   atol=TOL)
    programs = out[0][2]  # the whole process's count: each rank's device has its own programs
    assert programs <= 9 * cp, programs  # (each rank's own device: its own programs)


def test_zigzag_gives_every_rank_the_same_attention_flops():
    b, h, cp, c, d = 1, 2, 4, 3, 4
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((b, h, 2 * cp * c, d)) for _ in range(4))
    pair = 4 * b * h * c * c * d  # QKᵀ and PV of one c x c chunk pair, 2·c·c·d FLOPs each
    zig = [o[2] for o in run(_ring, ranks=cp, q=q, k=k, v=v, g=g, layout="zigzag", causal=True)]
    con = [o[2] for o in run(_ring, ranks=cp, q=q, k=k, v=v, g=g, layout="contiguous", causal=True)]
    # zig-zag: chunks r and 2cp-1-r see 2 chunk pairs of every other rank and 3 of their own
    assert [s.forward_flops for s in zig] == [(2 * cp + 1) * pair] * cp
    assert [s.backward_flops for s in zig] == [2 * (2 * cp + 1) * pair] * cp
    # contiguous: rank r (chunks 2r, 2r+1) sees 4 pairs of each earlier rank and 3 of its own
    assert [s.forward_flops for s in con] == [(4 * r + 3) * pair for r in range(cp)]
    assert sum(s.forward_flops for s in zig) == sum(s.forward_flops for s in con)


def test_chunk_positions():
    assert chunk_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert chunk_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert chunk_positions(8, 2, 1, "contiguous").tolist() == [4, 5, 6, 7]
    with pytest.raises(ValueError, match=r"length 10 does not split into 2 x cp = 4 .* multiple of 4"):
        chunk_positions(10, 2, 0)
    with pytest.raises(ValueError, match=r"unknown context-parallel layout 'ring'"):
        chunk_positions(8, 2, 0, "ring")


CFG = GPTConfig(vocab_size=16, block_size=16, n_layer=2, n_head=2, d_model=8, dtype="float64")


def _serial_gpt(x, y):
    model = GPT(CFG)
    loss = model.loss(x, y)
    loss.backward()
    return float(loss.data), {k: p.grad for k, p in model.named_parameters()}


def _cp_gpt(comm, x, y, cp, tp, layout):
    from minidist.comm import Mesh, all_reduce
    from minidist.parallel.tensor.sharding import sharding_table, unshard
    from minidist.parallel.three_d import build_model

    mesh = Mesh(comm, cp=cp, tp=tp)
    model, loss_fn = build_model(CFG, mesh.tp)
    context_parallel(model, mesh.cp, layout)
    xs, ys = (shard_sequence(a, mesh.cp_rank, cp, layout) for a in (x, y))
    n_all, n_mine = int((y != -1).sum()), int((ys != -1).sum())
    logits = model(xs)
    loss = (loss_fn or ops.cross_entropy)(logits, ys) * (n_mine / n_all)  # my tokens' share of the mean
    loss.backward()
    total = float(all_reduce(mesh.cp, np.array([float(loss.data)]))[0])
    grads = {k: all_reduce(mesh.cp, p.grad) for k, p in model.named_parameters()}  # token partial sums
    if tp > 1:
        grads = unshard(mesh.tp.allgather_obj(grads), sharding_table(model))
    return total, grads


@pytest.mark.parametrize("cp,tp,layout", [(2, 1, "zigzag"), (4, 1, "contiguous"), (2, 2, "zigzag")])
def test_context_parallel_gpt_equals_serial_gpt(cp, tp, layout):
    rng = np.random.default_rng(1)
    x = rng.integers(0, 16, (2, 16))
    y = np.where(rng.random((2, 16)) < 0.2, -1, rng.integers(0, 16, (2, 16)))
    want_loss, want = _serial_gpt(x, y)
    for loss, grads in run(_cp_gpt, ranks=cp * tp, x=x, y=y, cp=cp, tp=tp, layout=layout):
        assert abs(loss - want_loss) <= TOL
        assert grads.keys() == want.keys()
        for k in want:
            np.testing.assert_allclose(grads[k], want[k], rtol=0, atol=TOL, err_msg=k)


def _packed_ring(comm, qkv, g, heads):
    """Packed ring attention forward and backward on the rank's backend, results on the host."""
    be, cp = comm.backend, comm.size
    x = Tensor(be.from_host(shard_sequence(qkv, comm.rank, cp)), requires_grad=True)
    out = packed_ring_attention(x, heads, comm)
    out.backward(be.from_host(shard_sequence(g, comm.rank, cp)))
    return be.to_host(out.data), be.to_host(x.grad)


@pytest.mark.parametrize("backend", ["numpy", "jax"])
def test_packed_ring_attention_equals_packed_attention(backend):
    """The context-parallel GPT's attention (heads split and merged inside one op, as the serial
    layer's ``ops.packed_attention``) gives the serial op's output and qkv gradient."""
    if backend == "jax":
        pytest.importorskip("jax")
    b, t, heads, d, cp = 2, 8, 2, 3, 2
    rng = np.random.default_rng(3)
    qkv, g = rng.standard_normal((b, t, 3 * heads * d)), rng.standard_normal((b, t, heads * d))
    x = Tensor(qkv.copy(), requires_grad=True)
    want = ops.packed_attention(x, heads)
    want.backward(g)
    out = run(_packed_ring, ranks=cp, backend=backend, qkv=qkv, g=g, heads=heads)
    np.testing.assert_allclose(unshard_sequence([o[0] for o in out]), want.data, rtol=0, atol=TOL)
    np.testing.assert_allclose(unshard_sequence([o[1] for o in out]), x.grad, rtol=0, atol=TOL)


def _peak_activations(comm, t):
    model = context_parallel(GPT(CFG), comm, "zigzag")
    x = np.zeros((1, t), np.int64)
    acct = MemoryAccountant()
    with acct.track_activations(model):
        loss = ops.cross_entropy(model(shard_sequence(x, comm.rank, comm.size)),
                                 shard_sequence(x, comm.rank, comm.size))
    peak = acct.peak_activation_bytes
    loss.backward()
    return peak


def test_activation_memory_per_rank_falls_as_t_over_cp():
    """Every saved array is per token (no T x T score matrix is kept): the peak is linear in T/cp."""
    one = run(_peak_activations, ranks=1, t=16)[0]
    assert run(_peak_activations, ranks=1, t=8)[0] * 2 == one  # linear in T, not quadratic
    for cp in (2, 4):
        peaks = run(_peak_activations, ranks=cp, t=16)
        assert peaks == [one // cp] * cp, (cp, peaks, one)


def test_dropout_and_sequence_parallel_are_refused():
    with pytest.raises(ValueError, match=r"rank 0: context parallelism with dropout=0.1 is not built"):
        run(lambda comm: context_parallel(GPT(CFG.replace(dropout=0.1)), comm), ranks=1)


def test_lesson_passes_and_exits_1_when_ring_attention_is_wrong(monkeypatch, capsys):
    from minidist.lessons import long_context as lesson

    lesson.main(["--ranks", "2", "--seq", "8"])
    out = capsys.readouterr().out
    assert out.count("PASS") == 3 and "FAIL" not in out and "F1" in out  # the timeline names blocks
    good = lesson.ring_attention
    monkeypatch.setattr(lesson, "ring_attention", lambda *a, **k: good(*a, **k) * 1.001)
    with pytest.raises(SystemExit) as e:
        lesson.main(["--ranks", "2", "--seq", "8"])
    assert e.value.code == 1 and "FAIL" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        lesson.main(["--ranks", "2", "--seq", "6"])
    assert e.value.code == 2



def test_packed_ring_attention_refuses_a_qkv_that_does_not_split_into_heads():
    """qkv's last axis must be 3·heads·head_dim; NumPy's reshape error named no argument."""
    from minidist.parallel.context.ring import packed_ring_attention

    qkv = Tensor(np.zeros((1, 4, 10)))
    with pytest.raises(ValueError, match=r"rank 0: packed_ring_attention: qkv of shape \(1, 4, 10\)"):
        run(lambda comm: packed_ring_attention(qkv, 2, comm), ranks=1)


def _ring_steps_on_jax(comm, q, k, v, g, layout):
    """Ring attention forward and backward on JAX: output and gradients on the host."""
    out = _ring_on_device(comm, q, k, v, g, layout)
    return out[0], out[1]


def test_compiled_ring_steps_equal_the_eager_steps(monkeypatch):
    """Each ring step's compute is one compiled call on JAX (``compiled.pure`` on attend_block and
    attend_block_backward); with the engine off the same steps run op by op. XLA fuses a compiled
    step's elementwise work (and may contract a multiply-add), so the two agree to a few ulps of
    float64, not bit for bit: within 1e-14 here, where values are O(1)."""
    pytest.importorskip("jax")
    cp, b, h, t, d, layout = 3, 1, 2, 12, 4, "zigzag"  # cp = 3: own, earlier and later blocks
    rng = np.random.default_rng(7)
    q, k, v, g = (rng.standard_normal((b, h, t, d)) for _ in range(4))
    fast = run(_ring_steps_on_jax, ranks=cp, backend="jax", q=q, k=k, v=v, g=g, layout=layout)
    monkeypatch.setenv("MINIDIST_JAX_JIT", "0")
    eager = run(_ring_steps_on_jax, ranks=cp, backend="jax", q=q, k=k, v=v, g=g, layout=layout)
    for f, e in zip(fast, eager):
        np.testing.assert_allclose(f[0], e[0], rtol=0, atol=1e-14)
        for fg, eg in zip(f[1], e[1]):
            np.testing.assert_allclose(fg, eg, rtol=0, atol=1e-14)


def test_context_parallel_refuses_grouped_query_attention_by_name():
    from minidist.comm import run as run_ranks
    from minidist.nn import GPT, GPTConfig
    from minidist.parallel.context.model import context_parallel as cp_model

    def body(comm):
        gqa = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=4, n_kv_head=2, d_model=8))
        with pytest.raises(ValueError, match=r"grouped-query.*n_kv_head=2 < n_head=4"):
            cp_model(gqa, comm)
        return True
    assert all(run_ranks(body, ranks=2))


def test_attention_stats_count_the_matmul_flops_of_each_chunk_pair():
    """Queries (B, H, 2c, D) = (2, 3, 8, 5): a chunk pair is c = 4 queries x 4 keys; forward QKᵀ and PV
    are 2·c·c·D FLOPs each per (batch, head), backward twice the forward. Three pairs, by hand."""
    stats = AttentionStats()
    stats.count(False, 3, (2, 3, 8, 5))
    per_pair = 2 * 3 * (2 * 4 * 4 * 5 + 2 * 4 * 4 * 5)
    assert (stats.pairs, stats.forward_flops, stats.backward_flops) == (3, 3 * per_pair, 0)
    stats.count(True, 3, (2, 3, 8, 5))
    assert (stats.pairs, stats.backward_flops) == (3, 2 * 3 * per_pair)
