"""The MoE block: routing with capacity against hand-worked tables, forward against a loop written
out here, gradients (outputs, load-balancing loss, z-loss) against finite differences, and its fused
steps against the chain of ops they replace, bit for bit."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist.autograd import ops
from minidist.autograd.tensor import Function, Tensor
from minidist.nn.moe import MoE, capacity, top_k_route
from tests.conftest import budget


def test_top2_routing_fills_first_choices_before_second_choices():
    probs = np.array([[0.6, 0.3, 0.1],    # token 0: expert 0, then 1
                      [0.5, 0.1, 0.4],    # token 1: 0, then 2
                      [0.7, 0.2, 0.1],    # token 2: 0 (full after 2 first choices: dropped), then 1
                      [0.1, 0.2, 0.7]])   # token 3: 2, then 1
    experts, slots = top_k_route(probs, k=2, cap=2)
    assert experts.tolist() == [[0, 1], [0, 2], [0, 1], [2, 1]]
    # first choices in token order: e0 gets t0, t1; t2's e0 is dropped; e2 gets t3.
    # then second choices: e1 gets t0 (slot 0), e2 gets t1 (slot 1), e1 gets t2 (slot 1), t3's e1 dropped
    assert slots.tolist() == [[0, 0], [1, 1], [-1, 1], [0, -1]]


def test_capacity_formula():
    assert capacity(10, 4, 1, 1.0) == 3        # ceil(10 / 4)
    assert capacity(10, 4, 2, 1.25) == 7       # ceil(1.25 * 2 * 10 / 4) = ceil(6.25)
    assert capacity(1, 8, 1, 0.5) == 1


def _gelu(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _reference(moe, x):
    """The block written as loops over tokens: softmax, top-k, capacity in priority order, gated sum."""
    logits = x @ moe.router.weight.data  # Linear weights are (in, out)
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    n, e, k = x.shape[0], moe.n_experts, moe.k
    cap = math.ceil(moe.capacity_factor * k * n / e)
    order = [[int(i) for i in sorted(range(e), key=lambda j: (-probs[t, j], j))[:k]] for t in range(n)]
    used, out, dropped = [0] * e, np.zeros_like(x), 0
    for j in range(k):
        for t in range(n):
            ex = order[t][j]
            if used[ex] == cap:
                dropped += 1
                continue
            used[ex] += 1
            gate = probs[t, ex] / (sum(probs[t, c] for c in order[t]) if k > 1 else 1.0)
            m = moe.experts[ex]
            h = _gelu(_lin(m.fc, x[t]))
            out[t] += gate * _lin(m.proj, h)
    f = np.bincount(np.array(order).ravel(), minlength=e) / (n * k)
    aux = e * float((f * probs.mean(0)).sum())
    lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    return out, dropped / (n * k), aux, float((lse ** 2).mean())


def _lin(layer, v):
    return v @ layer.weight.data + layer.bias.data


@given(e=st.integers(1, 4), k=st.integers(1, 2), n=st.integers(1, 9), cf=st.sampled_from([0.5, 1.0, 2.0]),
       seed=st.integers(0, 99))
@budget(20)
def test_forward_equals_the_loop_and_stats(e, k, n, cf, seed):
    k = min(k, e)
    moe = MoE(4, e, k, cf, hidden=6, dtype=np.float64, std=0.5, rng=np.random.default_rng(seed))
    x = np.random.default_rng(seed + 1).standard_normal((n, 4))
    want, dropped, aux, z = _reference(moe, x)
    got = moe(Tensor(x))
    np.testing.assert_allclose(got.data, want, rtol=0, atol=1e-12)
    assert abs(moe.stats.dropped_fraction - dropped) < 1e-12
    assert abs(float(moe.stats.aux_loss.data) - aux) < 1e-12
    assert abs(float(moe.stats.z_loss.data) - z) < 1e-12
    assert moe.stats.tokens_per_expert.sum() == n * k
    assert moe.stats.kept_per_expert.sum() == round(n * k * (1 - dropped))


@pytest.mark.parametrize("k,cf", [(1, 1.0), (2, 0.75)])
def test_gradients_equal_finite_differences(k, cf):
    rng = np.random.default_rng(3)
    moe = MoE(3, 4, k, cf, hidden=5, dtype=np.float64, std=0.5, rng=rng)
    x0, g = rng.standard_normal((6, 3)), rng.standard_normal((6, 3))

    def loss_of():
        x = Tensor(x0, requires_grad=True)
        y = moe(x)
        loss = (y * Tensor(g)).sum() + moe.stats.aux_loss * 0.3 + moe.stats.z_loss * 0.2
        return x, loss

    moe.zero_grad()
    x, loss = loss_of()
    loss.backward()
    assert moe.stats.dropped_fraction > 0 or cf >= 1  # the dropping case really drops
    checks = [(x0, x.grad), (moe.router.weight.data, moe.router.weight.grad),
              (moe.experts[1].fc.weight.data, moe.experts[1].fc.weight.grad)]
    for arr, grad in checks:
        num = np.zeros_like(arr)
        for i in np.ndindex(arr.shape):
            old = arr[i]
            arr[i] = old + 1e-6
            up = float(loss_of()[1].data)
            arr[i] = old - 1e-6
            down = float(loss_of()[1].data)
            arr[i] = old
            num[i] = (up - down) / 2e-6
        np.testing.assert_allclose(grad, num, rtol=1e-6, atol=1e-7)


def test_load_balancing_loss_is_one_when_uniform_and_bad_arguments_are_refused():
    moe = MoE(2, 4, 1, 1.0, dtype=np.float64)
    moe.router.weight.data[...] = 0                      # every prob 1/4, ties -> expert 0
    moe(Tensor(np.ones((8, 2))))
    assert moe.stats.tokens_per_expert.tolist() == [8, 0, 0, 0]
    assert abs(float(moe.stats.aux_loss.data) - 4 * 1.0 * 0.25) < 1e-15  # E · f_0 · P_0 = 4 · 1 · 1/4
    assert moe.stats.dropped_fraction == 6 / 8            # capacity 2 of 8
    with pytest.raises(ValueError, match=r"1 <= k <= n_experts, got n_experts=2, k=3"):
        MoE(2, 2, k=3)
    with pytest.raises(ValueError, match=r"capacity_factor must be > 0"):
        MoE(2, 2, capacity_factor=0)


def _moe_step(backend, x, g, k=2, cf=0.75, host_input=False):
    """One forward and backward of a float64 MoE on ``backend``: output, input and parameter
    gradients, losses, stats, all on the host. ``host_input``: x stays a NumPy array (as the lesson
    feeds it), only the parameters live on ``backend``."""
    from minidist.accel.backend import get_backend

    be = get_backend(backend)
    moe = MoE(4, 4, k, cf, hidden=6, dtype=np.float64, std=0.5, rng=np.random.default_rng(11),
              backend=backend)
    xt = Tensor(x if host_input else be.from_host(x), requires_grad=True)
    y = moe(xt)
    loss = (y * Tensor(be.from_host(g))).sum() + moe.stats.aux_loss * 0.3 + moe.stats.z_loss * 0.2
    loss.backward()
    grads = {n: be.to_host(p.grad) for n, p in moe.named_parameters()}
    return moe, be.to_host(y.data), be.to_host(xt.grad), grads, float(be.to_host(loss.data))


@pytest.mark.parametrize("host_input", [False, True])
def test_moe_on_jax_pads_to_one_shape_and_equals_numpy_with_uneven_routing(host_input):
    """On JAX the kept assignments are padded to N·k (a padded one adds exact zeros): outputs equal
    the loop reference, gradients and loss equal NumPy's (float64), on steps whose routing keeps a
    different number of tokens per expert and drops some -- and after the first step, no step
    compiles a new program, whatever the routing."""
    pytest.importorskip("jax")
    from minidist.accel import jax_engine

    rng = np.random.default_rng(5)
    kept_counts, programs = set(), []
    for step, shift in enumerate([0.0, 1.0, 2.5, -1.5]):
        x, g = rng.standard_normal((10, 4)) + shift, rng.standard_normal((10, 4))
        ref, y_np, xg_np, grads_np, loss_np = _moe_step("numpy", x, g)
        before = jax_engine.compilations()
        moe, y, xg, grads, loss = _moe_step("jax", x, g, host_input=host_input)
        programs.append(jax_engine.compilations() - before)
        kept_counts.add(tuple(moe.stats.kept_per_expert))
        assert tuple(moe.stats.kept_per_expert) == tuple(ref.stats.kept_per_expert)
        want, dropped, _, _ = _reference(ref, x)
        assert dropped > 0, f"step {step}: the capacity should drop tokens"
        np.testing.assert_allclose(y, want, rtol=0, atol=1e-12, err_msg=f"step {step}")
        np.testing.assert_allclose(xg, xg_np, rtol=1e-12, atol=1e-12, err_msg=f"step {step}")
        for name in grads_np:
            np.testing.assert_allclose(grads[name], grads_np[name], rtol=1e-12, atol=1e-12,
                                       err_msg=f"step {step}: {name}")
        assert abs(loss - loss_np) <= 1e-12 * max(1.0, abs(loss_np))
    assert len({sum(c) for c in kept_counts}) > 1, f"routing kept the same count every step: {kept_counts}"
    if jax_engine.enabled():
        assert programs[0] > 0 and programs[1:] == [0, 0, 0], f"programs per step: {programs}"


# -- the fused steps (minidist/nn/moe_steps.py) against the chain of ops they replace --------------

class _ScatterRows(Function):
    """out (n, d) = zeros, out[index[i]] += rows[i]; backward g[index] (the chain's row scatter)."""

    @staticmethod
    def forward(ctx, rows, index, n):
        ctx.index = index
        out = np.zeros((n, *rows.shape[1:]), dtype=rows.dtype)
        np.add.at(out, index, rows)
        return out

    @staticmethod
    def backward(ctx, g):
        return g[ctx.index], None, None


def _chain(moe, x):
    """The block as a chain of ``minidist.autograd.ops`` (NumPy): gather, gate, scatter, one module call per
    expert, concat, and the two losses spelled op by op -- what the fused steps must equal bit for bit."""
    xf = x.reshape(-1, x.shape[-1])
    n, e, k = xf.shape[0], moe.n_experts, moe.k
    logits = moe.router(xf)
    probs = ops.softmax(logits, axis=-1)
    cap = capacity(n, e, k, moe.capacity_factor)
    experts, slots = top_k_route(probs.data, k, cap)
    gates = probs[np.arange(n)[:, None], experts]
    if k > 1:
        gates = gates / gates.sum(axis=-1, keepdims=True)
    tok, choice = np.nonzero(slots >= 0)
    rows = experts[tok, choice] * cap + slots[tok, choice]
    buf = _ScatterRows.apply(xf[tok], rows, e * cap)
    out_buf = ops.concat([ex(buf[i * cap:(i + 1) * cap]) for i, ex in enumerate(moe.experts)], axis=0)
    out = _ScatterRows.apply(out_buf[rows] * gates[tok, choice].reshape(-1, 1), tok, n)
    f = Tensor(np.bincount(experts.ravel(), minlength=e) / experts.size)
    aux = (probs.mean(axis=0) * f).sum() * e
    m = Tensor(logits.data.max(axis=-1, keepdims=True))
    lse = ((logits - m).exp().sum(axis=-1, keepdims=True)).log() + m
    return out.reshape(*x.shape), aux, (lse * lse).mean()


def _run(moe, x0, g, fn):
    moe.zero_grad()
    x = Tensor(x0, requires_grad=True)
    y, aux, z = fn(moe, x)
    ((y * Tensor(g)).sum() + aux * 0.3 + z * 0.2).backward()
    return [y.data, aux.data, z.data, x.grad] + [p.grad for p in moe.parameters()]


def _fused(moe, x):
    y = moe(x)
    return y, moe.stats.aux_loss, moe.stats.z_loss


@given(e=st.integers(1, 4), k=st.integers(1, 2), n=st.integers(1, 9), cf=st.sampled_from([0.5, 1.0, 2.0]),
       lead=st.sampled_from([(), (2,)]), seed=st.integers(0, 99))
@budget(20)
def test_fused_steps_equal_the_chain_of_ops_bit_for_bit(e, k, n, cf, lead, seed):
    """Outputs, both losses, the input's and every parameter's gradient: NumPy's bits are those of the
    ~55-op chain the steps replace (each backward is that chain's rule, in its order)."""
    k = min(k, e)
    moe = MoE(4, e, k, cf, hidden=6, dtype=np.float64, std=0.5, rng=np.random.default_rng(seed))
    rng = np.random.default_rng(seed + 1)
    x, g = rng.standard_normal((*lead, n, 4)), rng.standard_normal((*lead, n, 4))
    for got, want in zip(_run(moe, x, g, _fused), _run(moe, x, g, _chain), strict=True):
        np.testing.assert_array_equal(got, want)


def test_block_is_seven_ops_and_experts_behind_a_wrapper_are_called_one_by_one():
    """Forward: router Linear, Softmax, Dispatch, ExpertMLPs, Combine, and the two losses. An expert
    some technique wraps (here a counting wrapper) is called as a module instead -- same bits."""
    rng = np.random.default_rng(0)
    x, g = rng.standard_normal((12, 4)), rng.standard_normal((12, 4))
    moe = MoE(4, 3, 2, 1.0, hidden=6, dtype=np.float64, std=0.5, rng=np.random.default_rng(1))
    moe(Tensor(x, requires_grad=True))
    seen, stack = set(), [moe.stats.aux_loss._node, moe.stats.z_loss._node]
    nodes = []
    while stack:
        node = stack.pop()
        if node is None or isinstance(node, Tensor) or id(node) in seen:
            continue
        seen.add(id(node))
        nodes.append(node.fn.__name__)
        stack.extend(node.parents)
    y = moe(Tensor(x, requires_grad=True))
    out_nodes = [y._node.fn.__name__] + [p.fn.__name__ for p in y._node.parents if hasattr(p, "fn")]
    assert sorted(nodes) == ["Linear", "LoadBalancingLoss", "RouterZLoss", "Softmax"]
    assert out_nodes == ["Combine", "ExpertMLPs", "Softmax"]
    assert [p.fn.__name__ for p in y._node.parents[0].parents if hasattr(p, "fn")] == ["Dispatch"]
    fused = _run(moe, x, g, _fused)
    calls = []
    moe.experts[1].register_forward_wrapper(lambda m, inner, *a: calls.append(1) or inner(*a), "trace")
    looped = _run(moe, x, g, _fused)
    assert calls == [1]  # the wrapped expert was called as a module
    for got, want in zip(looped, fused, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("low", ["bf16", "fp16"])
def test_low_precision_experts_compute_like_their_modules(low):
    """Under autocast the experts' 2-byte weights send the block down the module path (``ops.linear``
    multiplies them in fp32, rounds once): the output and every gradient stay in the low dtype, and
    equal the path forced by a no-op wrapper bit for bit. bf16 is kind "V", not "f": the check that
    looked for kind "f" let bf16 experts into the fused op, whose bf16 products came out float32."""
    from minidist.parallel.memory.precision import autocast, low_dtype

    dt = low_dtype(low)
    rng = np.random.default_rng(0)
    x, g = rng.standard_normal((12, 4)).astype(dt), rng.standard_normal((12, 4)).astype(dt)
    runs = []
    for wrapped in (False, True):
        moe = autocast(MoE(4, 3, 2, 1.0, hidden=6, std=0.5, rng=np.random.default_rng(1)), low)
        if wrapped:
            for ex in moe.experts:
                ex.register_forward_wrapper(lambda m, inner, *a: inner(*a), "trace")
        xt = Tensor(x, requires_grad=True)
        y = moe(xt)
        (y * Tensor(g)).sum().backward()
        grads = [p.grad for p in moe.experts.parameters()]
        assert y.dtype == dt and xt.grad.dtype == dt and all(q.dtype == dt for q in grads)
        runs.append([y.data, xt.grad, *grads])
    for got, want in zip(*runs, strict=True):
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


def test_routed_fraction_counts_all_n_times_k_choices_and_ties_go_to_the_lower_expert():
    """f_e over the N·k choices, by hand: 3 tokens, top-2 over 4 experts -- choices (0, 1), (0, 2),
    (3, 0): expert 0 has 3 of the 6, 1, 2, 3 one each. Equal probabilities pick the lower expert."""
    from minidist.nn.moe import routed_fraction

    experts = np.array([[0, 1], [0, 2], [3, 0]])
    np.testing.assert_array_equal(routed_fraction(experts, 4), [0.5, 1 / 6, 1 / 6, 1 / 6])
    tied, _ = top_k_route(np.array([[0.25, 0.25, 0.25, 0.25], [0.1, 0.45, 0.45, 0.0]]), k=2, cap=2)
    assert tied.tolist() == [[0, 1], [1, 2]]
