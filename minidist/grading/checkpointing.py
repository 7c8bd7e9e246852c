"""Grader for exercises/checkpointing.py: a recomputation that replays the random state, and the best k.

``recompute`` is run on a two-layer MLP block with dropout (p=0.5), against the same block run
plainly from the same seed: output, input and parameter gradients, and the random state after
backward must match bit for bit; a saved-tensor hook counts what the recomputed forward keeps.
``best_segment_size`` is compared with a brute-force search over the cost written out here.
"""

import types

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minidist.autograd import ops
from minidist.autograd import random as mrandom
from minidist.autograd.tensor import Function, Tensor, enable_grad, no_grad, run_backward, saved_tensors_hooks
from minidist.grading import assert_close, untouched
from minidist.nn import Linear
from minidist.parallel.memory.recompute import recompute as library_recompute

GRADE = settings(max_examples=10, deadline=None, derandomize=True, database=None, report_multiple_bugs=False)


def _block(d, seed):
    rng = np.random.default_rng(seed)
    l1 = Linear(d, 2 * d, dtype=np.float64, rng=rng)
    l2 = Linear(2 * d, d, dtype=np.float64, rng=rng)

    def fn(x):
        return l2(ops.dropout(ops.tanh(l1(x)), 0.5, mrandom.default_generator()))
    return fn, [l1.weight, l1.bias, l2.weight, l2.bias]


def _run(call, b, d, seed, count_saved=False):
    """Forward + backward of ``dropout(call(fn, x))``: (y, grads, random state after forward and after
    backward, elements saved by ``call``)."""
    fn, params = _block(d, seed)
    rng = np.random.default_rng(seed + 1)
    x = Tensor(rng.standard_normal((b, d)), requires_grad=True)
    g = rng.standard_normal((b, d))
    mrandom.manual_seed(seed)
    saved = []
    if count_saved:
        with saved_tensors_hooks(lambda a: (saved.append(np.size(a)), a)[1], lambda a: a):
            y = call(fn, x)
    else:
        y = call(fn, x)
    z = ops.dropout(y, 0.5, mrandom.default_generator())  # the rest of the model draws too
    after_forward = mrandom.get_state()["state"]["state"]
    run_backward(z, g)
    grads = [x.grad] + [p.grad for p in params]
    return np.array(y.data), grads, after_forward, mrandom.get_state()["state"]["state"], sum(saved)


def check_recompute(impl):
    @GRADE
    @given(b=st.integers(1, 4), d=st.integers(2, 5), seed=st.integers(0, 99))
    @example(b=2, d=3, seed=0)
    def prop(b, d, seed):
        what = f"MLP block with dropout 0.5, x ({b}, {d}) float64, seed {seed}"
        y0, g0, fwd0, end0, _ = _run(lambda fn, x: fn(x), b, d, seed)
        y, grads, fwd, end, kept = _run(untouched(impl.recompute), b, d, seed, count_saved=True)
        assert isinstance(y, np.ndarray), f"{what}: recompute must return a Tensor"
        assert_close(y, y0, f"{what}: output")
        assert fwd == fwd0, f"{what}: forward drew a different number of random numbers than fn(x)"
        assert kept <= b * d, (f"{what}: the recomputed forward kept {kept} elements for backward; only "
                               f"its input ({b * d}) should be kept (run fn under no_grad)")
        names = ["x.grad", "l1.weight.grad", "l1.bias.grad", "l2.weight.grad", "l2.bias.grad"]
        for name, got, want in zip(names, grads, g0):
            assert got is not None, f"{what}: {name} is None (recompute with gradients on and back-propagate)"
            assert_close(got, want, f"{what}: {name} (replay the random state: dropout's mask must match)")
        assert end == end0, (f"{what}: after backward the random state differs from the plain run's: put it "
                             "back after the recomputation")
    prop()


def _expected_k(n, bt, a):
    costs = [(-(-n // k)) * bt + k * a for k in range(1, n + 1)]
    return 1 + costs.index(min(costs))


def check_best_segment_size(impl):
    @GRADE
    @given(n=st.integers(1, 40), bt=st.integers(1, 10 ** 5), a=st.integers(1, 10 ** 6))
    @example(n=8, bt=16384, a=426496)  # chapter 6's GPT: k* = sqrt(8·16384/426496) = 0.55, so k = 1
    @example(n=16, bt=1000, a=1000)  # equal sizes: k* = sqrt(16) = 4
    def prop(n, bt, a):
        got, want = impl.best_segment_size(n, bt, a), _expected_k(n, bt, a)
        cost = lambda k: (-(-n // k)) * bt + k * a  # noqa: E731
        assert got == want, (f"best_segment_size(n_layers={n}, segment_input={bt}, block_saved={a}) = {got}"
                             + (f" (cost {cost(got)})" if isinstance(got, int) and 1 <= got <= n else "")
                             + f"; expected {want} (cost {cost(want)}); k* = sqrt(L·BTC/A) = "
                               f"{np.sqrt(n * bt / a):.2f}")
    prop()


CHECKS = {"recompute": check_recompute, "best_segment_size": check_best_segment_size}
POINTS = {"recompute": 4, "best_segment_size": 2}


# -- minidist's own implementation (must pass) ---------------------------------------------------

def reference():
    def best_segment_size(n_layers, segment_input, block_saved):
        return _expected_k(n_layers, segment_input, block_saved)

    return types.SimpleNamespace(recompute=library_recompute, best_segment_size=best_segment_size)


# -- deliberately broken implementations (must fail) ---------------------------------------------

def _make(replay=True, restore=True, grad_on=True):
    class _Recompute(Function):
        @staticmethod
        def forward(ctx, x, fn):
            ctx.fn, ctx.state = fn, mrandom.get_state()
            ctx.save(x)
            with no_grad():
                return fn(Tensor(x)).data

        @staticmethod
        def backward(ctx, grad):
            now = mrandom.get_state()
            if replay:
                mrandom.set_state(ctx.state)
            leaf = Tensor(ctx.saved[0], requires_grad=True)
            if grad_on:
                with enable_grad():
                    out = ctx.fn(leaf)
                run_backward(out, grad)
            else:
                with no_grad():
                    ctx.fn(leaf)
            if restore:
                mrandom.set_state(now)
            return (leaf.grad,)

    def recompute(fn, x):
        return _Recompute.apply(x, fn=fn)
    recompute.__name__ = f"recompute_replay{replay}_restore{restore}_grad{grad_on}"
    return recompute


def _keeps_the_graph(fn, x):  # right numbers, no memory saved
    return fn(x)


def _sqrt_l(n_layers, segment_input, block_saved):  # the textbook sqrt(L), whatever the sizes
    return max(1, round(np.sqrt(n_layers)))


def _k_star_unclamped(n_layers, segment_input, block_saved):  # may return 0, or more than L
    return round(np.sqrt(n_layers * segment_input / block_saved))


BROKEN = {"recompute": [_make(replay=False), _make(restore=False), _make(grad_on=False), _keeps_the_graph],
          "best_segment_size": [_sqrt_l, _k_star_unclamped]}
