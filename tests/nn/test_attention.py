"""Grouped-query attention (Ainslie et al. 2023) against the paper's definition written in NumPy.

The reference below loops over query heads: head h takes its query columns, the key/value columns
of K/V head h // (H / K), and runs causal softmax attention -- nothing from minidist.
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist.autograd.tensor import Tensor, no_grad
from minidist.nn import GPT, GPTConfig
from minidist.nn.attention import CausalSelfAttention, split_heads
from tests.conftest import budget


def reference_gqa(x, w, b, wo, bo, n_head, n_kv_head):
    """The paper's GQA, head by head: (B, T, C) -> (B, T, C)."""
    bsz, t, c = x.shape
    d = c // n_head
    qkv = x @ w + b
    q, k, v = qkv[..., :c], qkv[..., c:c + n_kv_head * d], qkv[..., c + n_kv_head * d:]
    group = n_head // n_kv_head
    out = np.zeros((bsz, t, c))
    for h in range(n_head):
        j = h // group
        qh, kh, vh = q[..., h * d:(h + 1) * d], k[..., j * d:(j + 1) * d], v[..., j * d:(j + 1) * d]
        s = qh @ kh.transpose(0, 2, 1) / np.sqrt(d)
        s = np.where(np.tril(np.ones((t, t), dtype=bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[..., h * d:(h + 1) * d] = (p / p.sum(-1, keepdims=True)) @ vh
    return out @ wo + bo


def layer(n_head, n_kv_head, dim, seed=0):
    attn = CausalSelfAttention(dim, n_head, dtype=np.float64, rng=np.random.default_rng(seed),
                               n_kv_head=n_kv_head)
    rng = np.random.default_rng(seed + 1)  # nonzero biases, so a misplaced bias column shows
    attn.qkv.bias.data = rng.normal(size=attn.qkv.bias.shape)
    attn.proj.bias.data = rng.normal(size=attn.proj.bias.shape)
    return attn


def params(attn):
    return (attn.qkv.weight.numpy(), attn.qkv.bias.numpy(), attn.proj.weight.numpy(), attn.proj.bias.numpy())


@budget(25)
@given(st.sampled_from([(4, 4), (4, 2), (4, 1), (6, 3), (6, 2), (8, 2)]), st.integers(1, 3),
       st.integers(1, 7), st.integers(1, 3), st.integers(0, 99))
def test_gqa_forward_equals_the_papers_definition(heads, b, t, d, seed):
    n_head, n_kv = heads
    attn = layer(n_head, n_kv, n_head * d, seed)
    assert attn.qkv.weight.shape == (n_head * d, (n_head + 2 * n_kv) * d)
    x = np.random.default_rng(seed).normal(size=(b, t, n_head * d))
    got = attn(Tensor(x)).numpy()
    np.testing.assert_allclose(got, reference_gqa(x, *params(attn), n_head, n_kv), rtol=1e-10, atol=1e-12)


def repeated_as_mha(gqa, n_head, n_kv, dim):
    """An MHA layer whose K/V heads are GQA's, each repeated for the query heads of its group."""
    d, g = dim // n_head, n_head // n_kv
    mha = layer(n_head, n_head, dim)
    w, b, wo, bo = params(gqa)
    cols = list(range(dim))
    for part in (0, 1):  # k, then v: MHA head h gets GQA's head h // g
        start = dim + part * n_kv * d
        cols += [start + (h // g) * d + i for h in range(n_head) for i in range(d)]
    mha.qkv.weight.data, mha.qkv.bias.data = w[:, cols].copy(), b[cols].copy()
    mha.proj.weight.data, mha.proj.bias.data = wo.copy(), bo.copy()
    return mha, cols


@pytest.mark.parametrize("n_head,n_kv", [(4, 2), (4, 1), (6, 3)])
def test_gqa_gradients_equal_mha_with_repeated_kv_weights(n_head, n_kv):
    """Forward equal, and each GQA K/V weight's gradient = the sum over the MHA copies of it."""
    dim, d = 2 * n_head, 2
    gqa = layer(n_head, n_kv, dim, seed=5)
    mha, cols = repeated_as_mha(gqa, n_head, n_kv, dim)
    x = np.random.default_rng(1).normal(size=(2, 5, dim))
    go = np.random.default_rng(2).normal(size=(2, 5, dim))
    outs, xgrads = [], []
    for m in (gqa, mha):
        xt = Tensor(x, requires_grad=True)
        y = m(xt)
        (y * Tensor(go)).sum().backward()
        outs.append(y.numpy())
        xgrads.append(xt.grad)
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(xgrads[0], xgrads[1], rtol=1e-10, atol=1e-12)
    want_w = np.zeros_like(gqa.qkv.weight.numpy())
    want_b = np.zeros_like(gqa.qkv.bias.numpy())
    np.add.at(want_w.T, cols, mha.qkv.weight.grad.T)  # the MHA columns summed into the GQA ones
    np.add.at(want_b, cols, mha.qkv.bias.grad)
    assert len(set(cols)) == dim + 2 * n_kv * d
    np.testing.assert_allclose(gqa.qkv.weight.grad, want_w, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(gqa.qkv.bias.grad, want_b, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(gqa.proj.weight.grad, mha.proj.weight.grad, rtol=1e-10, atol=1e-12)


def test_split_heads_lays_out_q_then_k_then_v():
    """Columns: H query heads, then K key heads, then K value heads, D each."""
    n_head, n_kv, d = 4, 2, 3
    qkv = np.arange((n_head + 2 * n_kv) * d, dtype=np.float64)[None, None].repeat(2, axis=1)  # (1, 2, W)
    q, k, v = split_heads(qkv, n_head, n_kv)
    assert q.shape == (1, 4, 2, 3) and k.shape == v.shape == (1, 2, 2, 3)
    assert q[0, 3, 1].tolist() == [9, 10, 11]
    assert k[0, 1, 0].tolist() == [15, 16, 17]
    assert v[0, 0, 0].tolist() == [18, 19, 20]


def test_mqa_and_gqa_models_train_and_decode_like_recompute():
    """A GQA and an MQA GPT: the cached decode equals the full forward, logits and tokens."""
    from minidist.infer import generate, generate_recompute

    for n_kv in (2, 1):
        cfg = GPTConfig(vocab_size=11, block_size=12, n_layer=2, n_head=4, d_model=8, n_kv_head=n_kv,
                        dtype="float64", seed=2)
        model = GPT(cfg)
        got, lg = generate(model, [[1, 2, 3], [4, 5]], 6, return_logits=True)
        want, lw = generate_recompute(model, [[1, 2, 3], [4, 5]], 6, return_logits=True)
        assert got == want
        for a, b in zip(lg, lw):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-10)


def test_bad_kv_heads_are_refused_by_name():
    with pytest.raises(ValueError, match="n_kv_head must be a positive divisor of n_head 4"):
        GPTConfig(n_head=4, d_model=8, n_kv_head=3)
    with pytest.raises(ValueError, match="n_kv_head"):
        GPTConfig(n_head=4, d_model=8, n_kv_head=0)
    with pytest.raises(ValueError, match="n_kv_head"):
        CausalSelfAttention(8, 4, n_kv_head=8)
    assert GPTConfig(n_head=4, d_model=8).kv_heads == 4
    assert GPTConfig(n_head=4, d_model=8).replace(n_head=2).kv_heads == 2  # None follows n_head


def test_mha_layer_is_unchanged_by_default():
    """n_kv_head left out: the fused 3C projection and the same draws as before GQA existed."""
    a = CausalSelfAttention(8, 4, rng=np.random.default_rng(0))
    assert a.qkv.weight.shape == (8, 24) and a.n_kv_head == 4
    b = CausalSelfAttention(8, 4, rng=np.random.default_rng(0), n_kv_head=4)
    np.testing.assert_array_equal(a.qkv.weight.numpy(), b.qkv.weight.numpy())
    with no_grad():
        x = Tensor(np.ones((1, 3, 8), dtype=np.float32))
        np.testing.assert_array_equal(a(x).numpy(), b(x).numpy())


def test_planner_counts_the_gqa_models_parameters():
    """ModelSpec.of_gpt carries n_kv_head: its parameter count is the model's own."""
    from minidist.plan.model import ModelSpec

    for n_kv in (None, 2, 1):
        cfg = GPTConfig(vocab_size=11, block_size=12, n_layer=2, n_head=4, d_model=8, n_kv_head=n_kv)
        n = sum(int(np.prod(p.shape)) for p in GPT(cfg).parameters())
        assert ModelSpec.of_gpt("g", cfg).params() == n


# -- under tensor parallelism ------------------------------------------------------------------------

def _serial(cfg, idx, tgt):
    from minidist.autograd import ops

    model = GPT(cfg)
    logits = model(idx)
    loss = ops.cross_entropy(logits, tgt)
    loss.backward()
    return logits.numpy(), loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _tp_rank(comm, cfg, idx, tgt, sp):
    from minidist.parallel.tensor.gpt import TPGPT
    from minidist.parallel.tensor.sharding import sharding_table

    model = TPGPT(cfg, comm, sequence_parallel=sp)
    loss = model.loss_fn(model(idx), tgt)
    loss.backward()
    heads = (model[1].attn.local_heads, model[1].attn.local_kv_heads, model[1].attn.qkv.weight.shape)
    return (model.logits(idx).numpy(), loss.item(), {n: p.grad for n, p in model.named_parameters()},
            sharding_table(model), heads)


@pytest.mark.parametrize("n_head,n_kv,tp,sp,local_kv", [
    (4, 2, 2, False, 1),   # split: each rank one K/V head, its two query heads' group
    (4, 2, 2, True, 1),
    (4, 1, 2, False, 1),   # MQA: the one K/V head replicated
    (6, 3, 2, True, 3),    # 3 K/V heads, tp 2: replicated; rank 0's query heads 0,1,2 use K/V 0,0,1
    (8, 2, 4, False, 2),   # 2 K/V heads, tp 4: replicated
    (8, 4, 4, False, 1),
])
def test_tp_gqa_gpt_equals_serial(n_head, n_kv, tp, sp, local_kv):
    """Logits, loss and every gradient (unsharded by the model's own table) equal the serial GPT's."""
    from minidist.comm import run
    from minidist.parallel.tensor.sharding import unshard

    d = 2
    cfg = GPTConfig(vocab_size=2 * tp, block_size=8, n_layer=2, n_head=n_head, d_model=n_head * d,
                    n_kv_head=n_kv, dtype="float64", seed=n_head + n_kv)
    rng = np.random.default_rng(tp)
    idx = rng.integers(0, cfg.vocab_size, (2, 2 * tp))
    tgt = rng.integers(0, cfg.vocab_size, (2, 2 * tp))
    logits, loss, grads = _serial(cfg, idx, tgt)
    res = run(_tp_rank, ranks=tp, cfg=cfg, idx=idx, tgt=tgt, sp=sp)
    assert res[0][4] == (n_head // tp, local_kv, (n_head * d, (n_head // tp + 2 * local_kv) * d))
    for full, tp_loss, *_ in res:
        assert abs(tp_loss - loss) < 1e-10
        np.testing.assert_allclose(full, logits, atol=1e-10, rtol=0)
    tp_grads = unshard([r[2] for r in res], res[0][3])
    for name in grads:
        np.testing.assert_allclose(tp_grads[name], grads[name], atol=1e-10, rtol=0, err_msg=name)


def test_tp_sharded_generation_with_gqa_equals_serial_generation():
    from minidist.comm import run
    from minidist.infer import generate, sharded_generate

    for n_kv in (2, 1):
        cfg = GPTConfig(vocab_size=16, block_size=16, n_layer=2, n_head=4, d_model=16, n_kv_head=n_kv,
                        dtype="float64", seed=3)
        model = GPT(cfg).eval()
        want = generate(model, [[1, 2, 3], [4]], 6)
        got = run(lambda comm, m: sharded_generate(comm, m, [[1, 2, 3], [4]], 6, tp=2), ranks=2, m=model)
        assert got[0] == got[1] == want


def test_tp_refuses_what_cannot_split():
    from minidist.comm import run
    from minidist.parallel.tensor.gpt import TPGPT
    from minidist.parallel.tensor.sharding import kv_heads_split, kv_of_local_heads, local_kv_heads

    cfg = GPTConfig(vocab_size=12, block_size=8, n_layer=1, n_head=4, d_model=12, n_kv_head=2)
    with pytest.raises(ValueError, match="n_head = 4 is not divisible by the tensor-parallel size 3"):
        run(lambda comm: TPGPT(cfg, comm), ranks=3)
    assert kv_heads_split(8, 4, 2) and not kv_heads_split(8, 2, 4) and not kv_heads_split(8, 1, 2)
    assert local_kv_heads(8, 4, 2) == 2 and local_kv_heads(8, 2, 4) == 2 and local_kv_heads(8, 1, 8) == 1
    assert kv_of_local_heads(6, 3, 2, 1) == (1, 2, 2)  # query heads 3, 4, 5 -> K/V heads h // 2
    assert kv_of_local_heads(8, 4, 2, 1) is None


def test_shard_of_unequal_blocks_by_hand():
    """q|k|v of widths 4, 2, 2 over 2 ranks: q split, k and v split or kept whole."""
    from minidist.parallel.tensor.sharding import Shard

    full = np.arange(8)[None, :]  # columns q0 q1 q2 q3 | k0 k1 | v0 v1
    split, whole = Shard(1, widths=(4, 2, 2)), Shard(1, widths=(4, 2, 2), whole=(1, 2))
    assert split.split(full, 1, 2).tolist() == [[2, 3, 5, 7]]
    assert whole.split(full, 1, 2).tolist() == [[2, 3, 4, 5, 6, 7]]
    for s in (split, whole):
        assert s.concat([s.split(full, r, 2) for r in range(2)]).tolist() == full.tolist()
        assert s.local_shape((1, 8), 2) == s.split(full, 0, 2).shape
    with pytest.raises(ValueError, match="block 1 of width 2 .* must divide 2"):
        split.split(full, 0, 4)
