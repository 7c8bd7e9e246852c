"""The JAX engine (minidist/jax_engine.py): each op compiled once per shape gives the NumPy
engine's numbers, and ops that communicate stay eager."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from minidist import jax_engine, ops  # noqa: E402
from minidist.backend import get_backend  # noqa: E402
from minidist.nn import GPT, GPTConfig  # noqa: E402

CFG = GPTConfig(vocab_size=16, block_size=4, n_layer=1, n_head=2, d_model=8, dtype="float64")


def _loss_and_grads(backend):
    model = GPT(CFG, backend=backend)
    rng = np.random.default_rng(3)
    x, y = rng.integers(0, 16, (2, 4)), rng.integers(0, 16, (2, 4))
    loss = model.loss(x, y)
    loss.backward()
    be = get_backend(backend)
    return float(be.to_host(loss.data)), {k: be.to_host(p.grad) for k, p in model.named_parameters()}


def test_compiled_ops_give_the_numpy_engines_loss_and_gradients():
    if not jax_engine.enabled():
        pytest.skip("MINIDIST_JAX_JIT=0")
    want_loss, want = _loss_and_grads("numpy")  # the reference: NumPy, no JAX at all
    loss, grads = _loss_and_grads("jax")
    assert abs(loss - want_loss) <= 1e-12
    for k in want:
        np.testing.assert_allclose(grads[k], want[k], rtol=0, atol=1e-12, err_msg=k)
    compiled = {key[0].__name__ for key, entry in jax_engine._FORWARD.items() if entry}
    assert {"Linear", "LayerNorm", "Gelu", "PackedAttention"} <= compiled


def test_a_one_input_ops_gradient_keeps_its_shape():
    be = get_backend("jax")
    from minidist.tensor import Tensor

    x = Tensor(be.from_host(np.arange(6.0).reshape(2, 3)), requires_grad=True)
    (ops.gelu(x) * 2.0).sum().backward()  # Sum's backward returns one array, not a tuple
    h = np.arange(6.0).reshape(2, 3)
    c = np.sqrt(2 / np.pi)
    t = np.tanh(c * (h + 0.044715 * h ** 3))
    want = 2 * (0.5 * (1 + t) + 0.5 * h * (1 - t ** 2) * c * (1 + 3 * 0.044715 * h ** 2))
    np.testing.assert_allclose(np.asarray(x.grad), want, rtol=1e-12)


def test_ops_outside_minidist_ops_are_never_compiled():
    from minidist.parallel import tp_comm
    from minidist.tensor import Function

    comm_ops = [v for v in vars(tp_comm).values() if isinstance(v, type) and issubclass(v, Function)]
    assert comm_ops and all(jax_engine.kernel(c) is c for c in comm_ops)
    assert jax_engine.kernel(ops.Gelu) is not ops.Gelu


def test_dropout_draws_a_new_mask_every_call():
    """A host random generator is not baked into a compiled op: two calls, two masks (as NumPy)."""
    from minidist.tensor import Tensor

    be = get_backend("jax")
    x = Tensor(be.from_host(np.ones((4, 64))), requires_grad=True)
    rng = np.random.default_rng(0)
    a, b = (np.asarray(ops.dropout(x, 0.5, rng).data) for _ in range(2))
    ref = np.random.default_rng(0)
    want = [ops.dropout_mask((4, 64), 0.5, ref, np.float64) for _ in range(2)]
    np.testing.assert_array_equal(a, want[0])
    np.testing.assert_array_equal(b, want[1])


def test_a_saved_input_is_kept_as_itself_not_a_compiled_copy():
    """Memory: Linear saves x and w for backward; compiled, it must keep those very arrays."""
    from minidist.tensor import Tensor

    be = get_backend("jax")
    x = Tensor(be.from_host(np.ones((3, 4))), requires_grad=True)
    w = Tensor(be.from_host(np.ones((4, 2))), requires_grad=True)
    y = ops.linear(x, w)
    assert y._node.fn.__name__ == "JitLinear"
    saved = y._node.ctx.saved
    assert saved[0] is x.data and saved[1] is w.data
