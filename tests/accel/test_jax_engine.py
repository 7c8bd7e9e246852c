"""The JAX engine (minidist/accel/jax_engine.py): each op compiled once per shape gives the NumPy
engine's numbers, and ops that communicate stay eager."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

jax = pytest.importorskip("jax")

from minidist.accel import compiled as seam  # noqa: E402
from minidist.accel import jax_engine, jax_ops, jax_values  # noqa: E402
from minidist.accel.backend import get_backend  # noqa: E402
from minidist.autograd import ops  # noqa: E402
from minidist.nn import GPT, GPTConfig  # noqa: E402
from tests.conftest import budget  # noqa: E402

needs_engine = pytest.mark.skipif(not jax_engine.enabled(), reason="MINIDIST_JAX_JIT=0: nothing is compiled")

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
    compiled = {key[0].__name__ for key, entry in jax_ops._FORWARD.items() if entry}
    assert {"Linear", "LayerNorm", "Gelu", "PackedAttention"} <= compiled


def test_a_one_input_ops_gradient_keeps_its_shape():
    be = get_backend("jax")
    from minidist.autograd.tensor import Tensor

    x = Tensor(be.from_host(np.arange(6.0).reshape(2, 3)), requires_grad=True)
    (ops.gelu(x) * 2.0).sum().backward()  # Sum's backward returns one array, not a tuple
    h = np.arange(6.0).reshape(2, 3)
    c = np.sqrt(2 / np.pi)
    t = np.tanh(c * (h + 0.044715 * h ** 3))
    want = 2 * (0.5 * (1 + t) + 0.5 * h * (1 - t ** 2) * c * (1 + 3 * 0.044715 * h ** 2))
    np.testing.assert_allclose(np.asarray(x.grad), want, rtol=1e-12)


def test_ops_outside_minidist_ops_are_never_compiled():
    from minidist.autograd.tensor import Function
    from minidist.parallel.tensor import comm as tp_comm

    comm_ops = [v for v in vars(tp_comm).values() if isinstance(v, type) and issubclass(v, Function)]
    assert comm_ops and all(jax_engine.kernel(c) is c for c in comm_ops)
    assert jax_engine.kernel(ops.Gelu) is not ops.Gelu


# the 29 ops of minidist.autograd.ops (lessons/01-train.md lists them by kind), whichever file holds each
PLAIN_OPS = {"Add", "Sub", "Mul", "Div", "Neg", "Pow", "Exp", "Log", "Tanh", "Relu", "Gelu", "Cast",
             "Matmul", "Linear", "Sum", "Mean", "Max", "Reshape", "Transpose", "GetItem", "Concat",
             "Embedding", "Softmax", "LogSoftmax", "LayerNorm", "Dropout", "ScaledDotProductAttention",
             "PackedAttention", "CrossEntropy"}


def test_every_op_of_the_ops_package_compiles_and_nothing_outside_it_by_its_name():
    """The rule is the package, not one file: an op in any module of minidist/autograd/ops/ compiles;
    a subclass of one defined elsewhere (it may add communication) and a module whose name merely
    starts like the package's do not, unless they say ``compilable = True``."""
    import importlib
    import pkgutil

    from minidist.autograd.tensor import Function

    found = {}
    for info in pkgutil.iter_modules(ops.__path__):
        mod = importlib.import_module(f"{ops.__name__}.{info.name}")
        found |= {v.__name__: v for v in vars(mod).values()
                  if isinstance(v, type) and issubclass(v, Function) and v.__module__ == mod.__name__}
    assert set(found) == PLAIN_OPS
    assert all(jax_engine.kernel(c) is not c and issubclass(jax_engine.kernel(c), c) for c in found.values())

    class Elsewhere(ops.Dropout):
        pass

    lookalike = type("Lookalike", (Function,), {"__module__": "minidist.autograd.ops_extra"})
    declared = type("Declared", (Function,), {"__module__": "minidist.nn.moe_steps", "compilable": True})
    assert jax_engine.kernel(Elsewhere) is Elsewhere and jax_engine.kernel(lookalike) is lookalike
    assert jax_engine.kernel(declared) is not declared


def test_dropout_draws_a_new_mask_every_call():
    """A host random generator is not baked into a compiled op: two calls, two masks (as NumPy)."""
    from minidist.autograd.tensor import Tensor

    be = get_backend("jax")
    x = Tensor(be.from_host(np.ones((4, 64))), requires_grad=True)
    rng = np.random.default_rng(0)
    a, b = (np.asarray(ops.dropout(x, 0.5, rng).data) for _ in range(2))
    ref = np.random.default_rng(0)
    want = [ops.dropout_mask((4, 64), 0.5, ref, np.float64) for _ in range(2)]
    np.testing.assert_array_equal(a, want[0])
    np.testing.assert_array_equal(b, want[1])


@needs_engine
def test_a_saved_input_is_kept_as_itself_not_a_compiled_copy():
    """Memory: Linear saves x and w for backward; compiled, it must keep those very arrays."""
    from minidist.autograd.tensor import Tensor

    be = get_backend("jax")
    x = Tensor(be.from_host(np.ones((3, 4))), requires_grad=True)
    w = Tensor(be.from_host(np.ones((4, 2))), requires_grad=True)
    y = ops.linear(x, w)
    assert y._node.fn.__name__ == "JitLinear"
    saved = y._node.ctx.saved
    assert saved[0] is x.data and saved[1] is w.data


# -- fewer, larger compiled units (issue 19) ------------------------------------------------------
def _adamw_reference(params, grads, lrs, betas=(0.9, 0.999), eps=1e-8, wd=0.1):
    """AdamW written out in float64 NumPy, independent of minidist.nn.optim: the textbook formulas."""
    ps = [p.copy() for p in params]
    ms = [np.zeros_like(p) for p in params]
    vs = [np.zeros_like(p) for p in params]
    for t, (lr, gs) in enumerate(zip(lrs, grads), start=1):
        for i, g in enumerate(gs):
            ms[i] = betas[0] * ms[i] + (1 - betas[0]) * g
            vs[i] = betas[1] * vs[i] + (1 - betas[1]) * g * g
            m_hat, v_hat = ms[i] / (1 - betas[0] ** t), vs[i] / (1 - betas[1] ** t)
            ps[i] = ps[i] - lr * (m_hat / (np.sqrt(v_hat) + eps) + wd * ps[i])
    return ps, ms, vs


def _jax_params(shapes, seed):
    from minidist.nn import Parameter

    be = get_backend("jax")
    rng = np.random.default_rng(seed)
    host = [rng.standard_normal(s) for s in shapes]
    return host, [Parameter(be.from_host(h.copy())) for h in host]


def test_adamw_on_jax_is_one_compiled_call_per_step_and_follows_a_schedule():
    """Three steps with a new learning rate each step (a schedule): the parameters and m, v equal
    the textbook formulas; the first step compiles exactly one program for the whole update (no
    per-parameter or per-primitive programs); later steps, new lr and all, compile nothing."""
    if not jax_engine.enabled():
        pytest.skip("MINIDIST_JAX_JIT=0")
    from minidist.nn.optim import AdamW

    shapes = [(7, 13), (13,), (3, 11, 5)]  # shapes no other test uses: nothing compiled before
    host, params = _jax_params(shapes, seed=5)
    opt = AdamW(params, lr=0.01, weight_decay=0.1)
    rng = np.random.default_rng(6)
    grads = [[rng.standard_normal(s) for s in shapes] for _ in range(3)]
    lrs = [0.01, 0.004, 0.0007]
    be = get_backend("jax")
    compiled = []
    for lr, gs in zip(lrs, grads):
        opt.lr = lr
        for p, g in zip(params, gs):
            p.grad = be.from_host(g)
        calls, before = jax_engine.STATS["calls:adamw"], jax_engine.compilations()
        opt.step()
        assert jax_engine.STATS["calls:adamw"] == calls + 1  # one compiled call for all parameters
        compiled.append(jax_engine.compilations() - before)
    assert compiled == [1, 0, 0], f"programs compiled per step: {compiled} (want one, then none)"
    want_p, want_m, want_v = _adamw_reference(host, grads, lrs)
    for i, p in enumerate(params):
        np.testing.assert_allclose(np.asarray(p.data), want_p[i], rtol=0, atol=1e-13)
        np.testing.assert_allclose(np.asarray(opt.state[i]["m"]), want_m[i], rtol=0, atol=1e-15)
        np.testing.assert_allclose(np.asarray(opt.state[i]["v"]), want_v[i], rtol=0, atol=1e-15)


def test_sgd_with_momentum_on_jax_is_one_compiled_call_per_step():
    if not jax_engine.enabled():
        pytest.skip("MINIDIST_JAX_JIT=0")
    from minidist.nn.optim import SGD

    shapes = [(9, 2), (17,)]
    host, params = _jax_params(shapes, seed=8)
    opt = SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    rng = np.random.default_rng(9)
    be = get_backend("jax")
    want, bufs = [h.copy() for h in host], [None] * len(host)
    for lr in [0.1, 0.05, 0.02]:
        opt.lr = lr
        gs = [rng.standard_normal(s) for s in shapes]
        for p, g in zip(params, gs):
            p.grad = be.from_host(g)
        calls = jax_engine.STATS["calls:sgd"]
        opt.step()
        assert jax_engine.STATS["calls:sgd"] == calls + 1
        for i, g in enumerate(gs):  # heavy-ball momentum with decoupled-from-nothing L2 decay
            d = g + 0.01 * want[i]
            bufs[i] = d if bufs[i] is None else 0.9 * bufs[i] + d
            want[i] = want[i] - lr * bufs[i]
    for p, w in zip(params, want):
        np.testing.assert_allclose(np.asarray(p.data), w, rtol=0, atol=1e-13)


def test_a_second_training_step_compiles_nothing():
    """Forward, backward (CrossEntropy's forward and backward both compiled: its token count stays an
    array) and AdamW: after the first step every program exists, so the second compiles zero new ones."""
    if not jax_engine.enabled():
        pytest.skip("MINIDIST_JAX_JIT=0")
    from minidist.nn.optim import AdamW

    cfg = GPTConfig(vocab_size=11, block_size=5, n_layer=1, n_head=2, d_model=6, dtype="float64")
    model = GPT(cfg, backend="jax")
    opt = AdamW(model.parameters(), lr=1e-2)
    rng = np.random.default_rng(4)
    x, y = rng.integers(0, 11, (3, 5)), rng.integers(0, 11, (3, 5))
    counts = []
    for _ in range(3):
        before = jax_engine.compilations()
        loss = model.loss(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        counts.append(jax_engine.compilations() - before)
    assert counts[0] > 0 and counts[1:] == [0, 0], f"programs compiled per step: {counts}"
    assert any(k[0] is ops.CrossEntropy for k, fn in jax_ops._BACKWARD.items() if fn)
    assert any(k[0] is ops.CrossEntropy for k, fn in jax_ops._FORWARD.items() if fn)


@needs_engine
def test_ranks_meeting_a_new_op_at_once_compile_it_once():
    """Four threads (ranks) run the same new op shape at the same moment: one compilation each for
    its forward and its backward, not four (JAX does not merge concurrent compilations)."""
    import threading

    from minidist.autograd.tensor import Tensor

    be = get_backend("jax")
    barrier = threading.Barrier(4)
    errors = []

    def rank():
        try:
            x = Tensor(be.from_host(np.linspace(-1, 1, 23 * 3).reshape(23, 3)), requires_grad=True)
            barrier.wait()
            ops.gelu(x).sum().backward()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    before = jax_engine.compilations()
    threads = [threading.Thread(target=rank) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    # Gelu forward and backward, Sum forward and backward (the seed comes from the host): 4 programs
    # (4 ranks compiling each on their own would make ~16; none would mean nothing was compiled)
    assert 1 <= jax_engine.compilations() - before <= 4


def test_a_saved_python_number_stays_a_number_and_float32_stays_float32():
    """Mul by 2.0 saves the 2.0 for backward: compiled, it must come back as the number (a 0-d
    float64 array would count 8 bytes of activations and promote a float32 gradient to float64)."""
    from minidist.autograd.tensor import Tensor

    be = get_backend("jax")
    x = Tensor(be.from_host(np.ones((2, 3), np.float32)), requires_grad=True)
    y = ops.mul(x, 2.0)
    assert y._node.ctx.saved[1] == 2.0 and isinstance(y._node.ctx.saved[1], float)
    y.sum().backward()
    assert x.grad.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(x.grad), np.full((2, 3), 2.0, np.float32))


@needs_engine
def test_a_pure_helper_is_one_compiled_call_on_jax_and_itself_on_numpy():
    """``seam.pure``: a bucket's per-parameter views of a flat array, as DDP takes them."""

    @seam.pure
    def views(flat, offsets, shapes):
        return [flat[o:o + int(np.prod(s))].reshape(s) for o, s in zip(offsets, shapes)]

    flat = np.arange(29.0)
    offsets, shapes = (0, 6, 9), ((2, 3), (3,), (5, 4))
    want = [flat[0:6].reshape(2, 3), flat[6:9], flat[9:29].reshape(5, 4)]
    got_np = views(flat, offsets, shapes)
    assert all(type(g) is np.ndarray for g in got_np)  # NumPy: the function as written
    be = get_backend("jax")
    before = jax_engine.compilations()
    for _ in range(3):
        got = views(be.from_host(flat), offsets, shapes)
    assert jax_engine.compilations() - before == 1  # eager JAX: a slice and a reshape each, ~5 programs
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), w)


@needs_engine
def test_an_index_array_is_an_argument_not_a_constant():
    """``x[idx]`` with integer arrays (one, or a (rows, cols) tuple), as token ids and MoE routing
    index: the op is compiled (eager JAX indexing is ~7 programs per new shape), its values and
    gradients equal NumPy's (repeated ids add up), and a new index of the same shape compiles nothing."""
    from minidist.autograd.tensor import Tensor

    be = get_backend("jax")
    host = np.arange(35.0).reshape(7, 5)

    def grads(idx, backend):
        x = Tensor(get_backend(backend).from_host(host.copy()), requires_grad=True)
        y = ops.getitem(x, idx)
        (y * y).sum().backward()
        return np.asarray(y.data), np.asarray(x.grad)

    rng = np.random.default_rng(2)
    for make in (lambda: rng.integers(0, 7, 9), lambda: (rng.integers(0, 7, 6), rng.integers(0, 5, 6))):
        counts = []
        for _ in range(3):
            idx = make()
            before = jax_engine.compilations()
            got, gx = grads(idx, "jax")
            key = next((k for k in jax_ops._FORWARD if k[0] is ops.GetItem and k[3]), None)
            assert key and jax_ops._FORWARD[key], "GetItem with an index array (by keyword) ran eagerly"
            counts.append(jax_engine.compilations() - before)
            want, wx = grads(idx, "numpy")
            np.testing.assert_array_equal(got, want)
            np.testing.assert_allclose(gx, wx, rtol=0, atol=1e-12)
        assert counts[1:] == [0, 0], f"programs compiled per new index: {counts}"
    assert be.name == "jax"


@needs_engine
def test_a_slice_index_compiles_and_equals_numpy():
    """``x[:, 1:4]`` and ``split``: the slice reaches the op as a keyword value, which is unhashable
    before Python 3.12 -- such ops ran eagerly (~7 eager programs per new shape, 760 GetItems in the
    MoE lesson). The key now spells slices out, so the op compiles; values and gradients as NumPy's."""
    from minidist.autograd.tensor import Tensor

    host = np.arange(35.0).reshape(5, 7)

    def run(backend):
        x = Tensor(get_backend(backend).from_host(host.copy()), requires_grad=True)
        a, b = ops.split(x[:, 1:6], [2, 3], axis=1)
        ((a * a).sum() + (b * 3.0).sum()).backward()
        return np.asarray(x.grad)

    got = run("jax")
    assert any(k[0] is ops.GetItem and v for k, v in jax_ops._FORWARD.items()), "x[:, 1:6] ran eagerly"
    np.testing.assert_array_equal(got, run("numpy"))



_SLICE_PART = st.one_of(st.none(), st.integers(-8, 8))


@needs_engine
@budget(6)
@given(data=st.data())
def test_slices_differing_in_start_stop_or_step_never_share_a_program(data):
    """The program cache's key holds every part of a slice: a run of slices of one array that differ
    in start, stop or step (x[::1] then x[::2], x[1:5] then x[1:5:2], a negative step) each give
    NumPy's values and gradients, in any order -- a key without the step would reuse x[::1]'s program
    for x[::2] and return the wrong elements."""
    from minidist.autograd.tensor import Tensor

    host = np.arange(48.0).reshape(6, 8)
    slices = data.draw(st.lists(st.tuples(
        st.builds(slice, _SLICE_PART, _SLICE_PART, st.sampled_from([None, 1, 2, 3, -1, -2])),
        st.builds(slice, _SLICE_PART, _SLICE_PART, st.sampled_from([None, 1, 2, -1]))),
        min_size=2, max_size=4))

    def run(backend, idx):
        x = Tensor(get_backend(backend).from_host(host.copy()), requires_grad=True)
        y = ops.getitem(x, idx)
        if y.data.size:
            (y * y).sum().backward()
        grad = np.asarray(x.grad) if x.grad is not None else np.zeros_like(host)
        return np.asarray(y.data), grad

    for idx in [(slice(None, None, 1), slice(None)), (slice(None, None, 2), slice(None))] + slices:
        got, gx = run("jax", idx)
        want, wx = run("numpy", idx)
        assert got.shape == want.shape, idx
        np.testing.assert_array_equal(got, want, err_msg=str(idx))
        np.testing.assert_array_equal(gx, wx, err_msg=str(idx))

@needs_engine
def test_pure_keys_baked_numbers_by_type_and_finds_arrays_in_nested_lists():
    """``pure``: ``x * 2`` and ``x * 2.0`` are two programs (2 == 2.0 hash alike; one program for
    both returned int for the float), and arrays inside lists of lists are found (ring attention's
    [[dk0, dk1], [dv0, dv1]] ran eagerly)."""
    be = get_backend("jax")
    x = be.from_host(np.arange(3, dtype=np.int32))

    @seam.pure
    def times(a, c):
        return a * c

    assert str(times(x, 2.0).dtype) == "float64" and str(times(x, 2).dtype) == "int32"

    @seam.pure
    def pack(nested):
        return be.xp.concatenate([be.xp.concatenate(inner) for inner in nested])

    before = jax_engine.compilations()
    got = pack([[x, x], [x]])
    assert jax_engine.compilations() == before + 1, "nested lists of JAX arrays were not compiled"
    np.testing.assert_array_equal(np.asarray(got), np.tile(np.arange(3), 3))


@needs_engine
def test_clipping_on_jax_is_two_compiled_calls_whatever_the_scale():
    """Global-norm clipping: the norm (one program summing every gradient's squares in float64) and
    the scaling (one program, the scale an argument) equal the formulas; a second clip with a new
    scale compiles nothing."""
    from minidist.nn.optim import clip_grad_norm

    shapes = [(6, 7), (7,), (2, 3, 4)]
    host, params = _jax_params(shapes, seed=11)
    be = get_backend("jax")
    rng = np.random.default_rng(12)
    counts = []
    for max_norm in (0.5, 0.25):
        gs = [rng.standard_normal(s) for s in shapes]
        for p, g in zip(params, gs):
            p.grad = be.from_host(g)
        before = jax_engine.compilations()
        norm = clip_grad_norm(params, max_norm)
        counts.append(jax_engine.compilations() - before)
        want = np.sqrt(sum((g * g).sum() for g in gs))
        assert abs(norm - want) <= 1e-12 * want
        for p, g in zip(params, gs):
            np.testing.assert_allclose(np.asarray(p.grad), g * (max_norm / (want + 1e-6)), rtol=1e-14)
    assert counts == [2, 0], f"programs compiled per clip: {counts}"


def test_three_adamw_steps_of_a_gpt_on_jax_equal_numpys():
    """The whole engine at once: forward, backward, clipping and a warmup-cosine AdamW, three steps
    of a float64 GPT on each backend from the same weights; the parameters agree to 1e-10."""
    from minidist.nn.optim import AdamW, WarmupCosine, clip_grad_norm

    rng = np.random.default_rng(21)
    batches = [(rng.integers(0, 16, (2, 4)), rng.integers(0, 16, (2, 4))) for _ in range(3)]
    final = {}
    for backend in ("numpy", "jax"):
        model = GPT(CFG, backend=backend)
        opt = AdamW(model.parameters(), lr=3e-2, weight_decay=0.1)
        sched = WarmupCosine(opt, warmup=2, total=3)
        for x, y in batches:
            loss = model.loss(x, y)
            opt.zero_grad()
            loss.backward()
            clip_grad_norm(model.parameters(), 0.5)
            opt.step()
            sched.step()
        be = get_backend(backend)
        final[backend] = {k: be.to_host(p.data) for k, p in model.named_parameters()}
    for k, want in final["numpy"].items():
        np.testing.assert_allclose(final["jax"][k], want, rtol=0, atol=1e-10, err_msg=k)


def test_a_boolean_mask_after_an_integer_index_runs_eagerly_and_right():
    """A boolean mask cannot be traced (its result's shape depends on its values): after an integer
    index of the same op compiled, the mask's forward and backward fall back to eager and still
    give NumPy's values and gradients (the hypothesis op test found this one)."""
    from minidist.autograd.tensor import Tensor

    host = np.arange(6.0).reshape(3, 2)
    for idx in (np.array([0, 2]), np.array([True, False, True]), np.array([False, True, True])):
        got = {}
        for backend in ("numpy", "jax"):
            x = Tensor(get_backend(backend).from_host(host.copy()), requires_grad=True)
            y = ops.getitem(x, idx)
            (y * y).sum().backward()
            got[backend] = np.asarray(y.data), np.asarray(x.grad)
        np.testing.assert_array_equal(got["jax"][0], got["numpy"][0])
        np.testing.assert_array_equal(got["jax"][1], got["numpy"][1])


@needs_engine
def test_an_ops_key_holds_each_arrays_dtype_and_each_numbers_type():
    """Calls that differ only in an input's dtype, or in a number's type, never share a compiled op.
    Cast keeps its input's dtype (a static attribute) to cast the gradient back: one program for
    float32 and float16 inputs would hand one of them the other's gradient dtype. And 2 == 2.0 ==
    True hash alike, but an int32 array times 2.0 is a float array: the reference is eager JAX."""
    from minidist.autograd.tensor import Tensor

    be = get_backend("jax")
    for _ in range(2):  # the second round runs the programs the first one made
        for dt in (np.float32, np.float16, np.float64):
            x = Tensor(be.from_host(np.ones((2, 3), dt)), requires_grad=True)
            ops.Cast.apply(x, np.dtype(np.float64)).sum().backward()  # positional: no keywords
            assert x.grad.dtype == dt, f"the gradient of a {np.dtype(dt)} input came back {x.grad.dtype}"
            x.grad = None
            ops.cast(x, np.float64).sum().backward()  # a keyword, and NumPy's scalar type
            assert x.grad.dtype == dt, f"the gradient of a {np.dtype(dt)} input came back {x.grad.dtype}"
    compiled = [k for k, entry in jax_ops._FORWARD.items() if k[0] is ops.Cast and entry]
    assert len(compiled) >= 6, "Cast ran eagerly"
    n = be.from_host(np.arange(4, dtype=np.int32))
    for v in (2, 2.0, True, 2, 2.0):
        got = ops.Mul.apply(Tensor(n), v).data
        want = n * v  # eager JAX, not the engine
        assert got.dtype == want.dtype, f"int32 array * {v!r}: {got.dtype}, eager JAX gives {want.dtype}"
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # keywords and tuples are keyed the same way: equal values of other types stay apart
    values = (2, 2.0, True, (2,), (2.0,), [2], slice(0, 2), slice(0.0, 2.0))
    assert len({jax_values._value_key(v) for v in values}) == len(values)


@needs_engine
def test_a_forward_without_a_graph_returns_nothing_for_a_backward():
    """Under ``no_grad`` (evaluation, decoding) no backward will run: the compiled forward returns
    the output alone, not the activations it saves when a graph is built (each output costs a
    device buffer and ~1 us a call)."""
    from minidist.autograd.tensor import Tensor, no_grad

    be = get_backend("jax")
    h = np.linspace(-2, 2, 15).reshape(3, 5)
    x = Tensor(be.from_host(h), requires_grad=True)
    with no_grad():
        y = ops.gelu(x)
    z = ops.gelu(x)
    c = np.sqrt(2 / np.pi)
    want = 0.5 * h * (1 + np.tanh(c * (h + 0.044715 * h ** 3)))
    for t in (y, z):
        np.testing.assert_allclose(np.asarray(t.data), want, rtol=1e-12)
    saved = {k[5]: len(e[1]["inputs"]) for k, e in jax_ops._FORWARD.items()
             if k[0] is ops.Gelu and k[1] == (((3, 5), np.dtype(np.float64)),) and e}
    assert saved[False] == 0 and saved[True] >= 1, saved
