"""The GPT and training: gradients against central differences, learning a task, optimizers."""

import numpy as np
import pytest

from minidist.autograd.tensor import Tensor
from minidist.nn import GPT, GPTConfig, optim
from minidist.nn.data import BatchLoader, SyntheticTask, TextDataset
from tests.conftest import backends

TINY = GPTConfig(vocab_size=7, block_size=6, n_layer=2, n_head=2, d_model=4, dtype="float64", seed=3)


@pytest.mark.parametrize("n_kv_head", [None, 1])
@pytest.mark.parametrize("backend", backends())
def test_gpt_gradients_match_central_differences(backend, n_kv_head):
    """Every parameter tensor: 3 sampled entries of dL/dθ equal (L(θ+ε) - L(θ-ε)) / 2ε; also for
    multi-query attention (n_kv_head=1: both heads share one K/V head)."""
    from minidist.accel.backend import get_backend

    be = get_backend(backend)
    model = GPT(TINY.replace(n_kv_head=n_kv_head), backend=be)
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 7, (2, 5))
    tgt = rng.integers(0, 7, (2, 5))
    model.loss(idx, tgt).backward()
    eps = 1e-6
    for name, p in model.named_parameters():
        host = be.to_host(p.data).copy()
        for flat in rng.choice(host.size, size=min(3, host.size), replace=False):
            vals = []
            for step in (eps, -eps):
                pert = host.copy()
                pert.reshape(-1)[flat] += step
                p.data = be.from_host(pert)
                vals.append(model.loss(idx, tgt).item())
            p.data = be.from_host(host)
            numeric = (vals[0] - vals[1]) / (2 * eps)
            analytic = be.to_host(p.grad).reshape(-1)[flat]
            assert abs(numeric - analytic) < 1e-6 + 1e-5 * abs(numeric), (name, flat, numeric, analytic)


def test_head_gradient_is_the_hand_derived_formula():
    """dL/dW_head = hᵀ(softmax(h W) - onehot(y)) / N, with h the final LayerNorm's output."""
    from minidist.autograd.tensor import no_grad

    model = GPT(TINY)
    rng = np.random.default_rng(1)
    idx, tgt = rng.integers(0, 7, (3, 5)), rng.integers(0, 7, (3, 5))
    model.loss(idx, tgt).backward()
    head = model[-1]
    with no_grad():
        x = idx
        for layer in list(model)[:-1]:
            x = layer(x)
        h = head.ln(x).numpy().reshape(-1, TINY.d_model)
    logits = h @ head.proj.weight.numpy()
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    p[np.arange(p.shape[0]), tgt.reshape(-1)] -= 1
    np.testing.assert_allclose(head.proj.weight.grad, h.T @ p / p.shape[0], rtol=1e-10, atol=1e-12)


def test_gpt_learns_the_reverse_task():
    task = SyntheticTask("reverse", length=4, size=512, seed=0)
    cfg = GPTConfig(vocab_size=task.vocab_size, block_size=task.block_size, n_layer=2, n_head=2,
                    d_model=32, seed=0)
    model = GPT(cfg)
    opt = optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    loader = BatchLoader(task, batch_size=32, seed=0)
    losses = []
    for _ in range(250):
        x, y = loader.next_batch()
        loss = model.loss(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert np.mean(losses[:10]) > 2.0
    assert np.mean(losses[-10:]) < 0.5, losses[-10:]


def test_adamw_matches_reference_formula():
    rng = np.random.default_rng(0)
    w0, grads = rng.standard_normal(5), [rng.standard_normal(5) for _ in range(3)]
    p = Tensor(w0.copy(), requires_grad=True)
    opt = optim.AdamW([p], lr=0.1, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    m = v = np.zeros(5)
    w = w0.copy()
    for t, g in enumerate(grads, 1):
        p.grad = g
        opt.step()
        m, v = 0.9 * m + 0.1 * g, 0.99 * v + 0.01 * g * g
        w = w * (1 - 0.1 * 0.05) - 0.1 * (m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.99 ** t)) + 1e-8)
    np.testing.assert_allclose(p.data, w, rtol=1e-12)


def test_adamw_same_on_jax():
    pytest.importorskip("jax")
    from minidist.accel.backend import get_backend

    rng = np.random.default_rng(1)
    w0, g = rng.standard_normal(4), rng.standard_normal(4)
    out = []
    for be in (get_backend("numpy"), get_backend("jax")):
        p = Tensor(be.from_host(w0.copy()), requires_grad=True)
        opt = optim.AdamW([p], lr=0.1)
        for _ in range(3):
            p.grad = be.from_host(g)
            opt.step()
        out.append(be.to_host(p.data))
    np.testing.assert_allclose(out[0], out[1], rtol=1e-12)


def test_sgd_momentum_and_state_dict_roundtrip():
    p = Tensor(np.array([1.0, 2.0]), requires_grad=True)
    opt = optim.SGD([p], lr=0.5, momentum=0.9)
    p.grad = np.array([1.0, 1.0])
    opt.step()
    p.grad = np.array([1.0, 1.0])
    opt.step()
    np.testing.assert_allclose(p.data, [1.0 - 0.5 - 0.5 * 1.9, 2.0 - 0.5 - 0.5 * 1.9])
    sd = opt.state_dict()
    opt2 = optim.SGD([p], lr=0.1, momentum=0.9).load_state_dict(sd)
    np.testing.assert_allclose(opt2.state[0]["momentum"], [1.9, 1.9])


def test_clipping_and_schedule():
    ps = [Tensor(np.zeros(2), requires_grad=True), Tensor(np.zeros(1), requires_grad=True)]
    ps[0].grad, ps[1].grad = np.array([3.0, 0.0]), np.array([4.0])
    assert optim.clip_grad_norm(ps, 1.0) == pytest.approx(5.0)
    assert optim.global_grad_norm(ps) == pytest.approx(1.0, rel=1e-5)
    lrs = [optim.warmup_cosine(s, 10, 100) for s in range(120)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[-1] == pytest.approx(0.1) and all(a >= b for a, b in zip(lrs[10:100], lrs[11:100]))


def test_loader_resumes_on_the_same_batch():
    ds = TextDataset.from_file(block_size=16)
    a = BatchLoader(ds, 4, seed=5)
    for _ in range(7):
        a.next_batch()
    b = BatchLoader(ds, 4, seed=0).load_state_dict(a.state_dict())
    for _ in range(5):
        np.testing.assert_array_equal(a.next_batch()[0], b.next_batch()[0])


def test_state_dict_roundtrip_and_errors():
    m1, m2 = GPT(TINY), GPT(TINY.replace(seed=9))
    m2.load_state_dict(m1.state_dict())
    idx = np.zeros((1, 3), dtype=np.int64)
    np.testing.assert_array_equal(m1(idx).numpy(), m2(idx).numpy())
    with pytest.raises(ValueError, match="shape"):
        GPT(TINY.replace(d_model=6)).load_state_dict(m1.state_dict())
    with pytest.raises(ValueError, match="longer than the context"):
        m1(np.zeros((1, 7), dtype=np.int64))
    with pytest.raises(ValueError, match="not divisible"):
        GPTConfig(d_model=10, n_head=4)


def test_loss_names_targets_shaped_unlike_the_token_ids():
    m, idx = GPT(TINY), np.zeros((2, 5), dtype=np.int64)
    # (2, 4) raised NumPy's IndexError; (10,) -- the same count, flattened -- was taken in silence
    for shape in [(2, 4), (10,), (5, 2), (1, 2, 5)]:
        with pytest.raises(ValueError, match=rf"GPT.loss: targets must have the token ids' shape \(2, 5\) "
                                             rf"\(B, T\), got \({', '.join(map(str, shape))},?\)"):
            m.loss(idx, np.zeros(shape, dtype=np.int64))
    assert np.isfinite(m.loss(idx, np.ones((2, 5), dtype=np.int64)).item())  # (2, 5): taken


def test_a_text_shorter_than_one_window_names_the_largest_block_size():
    # 10 tokens hold one window of block_size + 1 = 10 (block_size 9), not of 11
    assert len(TextDataset(np.arange(10), 9)) == 1
    with pytest.raises(ValueError, match=r"TextDataset: text of 10 tokens .* must be <= 9, got 10"):
        TextDataset(np.arange(10), 10)
