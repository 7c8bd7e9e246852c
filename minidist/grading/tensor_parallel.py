"""Grader for exercises/tensor_parallel.py: column- and row-parallel linear == the serial x @ w + b.

``CHECKS[task](impl)`` raises AssertionError when ``impl.<task>`` is wrong. Forward checks run on
1..4 thread ranks (``minidist.comm.run``) and read the ledger (``measure``): column parallel sends
nothing, row parallel makes one all-reduce. They run here against minidist's own ColumnParallelLinear,
RowParallelLinear, split_columns and split_rows (must pass) and broken versions (must fail).
"""

import types

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minidist.autograd.tensor import Tensor
from minidist.comm import all_gather, all_reduce, measure
from minidist.grading import assert_close, no_hang, run_guarded, untouched
from minidist.parallel.tensor import layers as T
from minidist.parallel.tensor import sharding as S
from minidist.parallel.tensor import vocab as V

GRADE = settings(max_examples=12, deadline=None, derandomize=True, database=None, report_multiple_bugs=False)
SMALL = (1, np.ones((1, 1)), np.ones((1, 1)), np.ones(1))  # tried first: a stub fails fast, unshrunk
TOL = dict(rtol=1e-10, atol=1e-12)  # row parallel sums the partial products in another order


@st.composite
def layers(draw):
    """A serial layer and its input: x (..., n_in), w (n_in, n_out), b (n_out,); tp divides n_in, n_out."""
    tp = draw(st.integers(1, 4))
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))
    n_in, n_out = tp * draw(st.integers(1, 3)), tp * draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 99)))
    normal = rng.standard_normal
    return tp, normal(lead + (n_in,)), normal((n_in, n_out)), normal(n_out)


WAIT_S = 10  # a rank waiting longer than this for its peers fails the task (not the 300 s default)


def _close(got, want, what, exact=False):
    """got == want (exact) or within TOL; the error names the example and the first elements that
    differ from the block it should be (exact) or from x @ w + b."""
    where = f"{what}, compared with " + ("the block it should be" if exact else "x @ w + b")
    assert_close(got, want, where, **({} if exact else TOL))


def _on_ranks(tp, fn):
    """fn(comm) on tp thread ranks: [(result, messages sent, names of collective calls)] by rank."""
    def body(comm):
        with measure(comm) as m:
            out = fn(comm)
        return out, m.messages, [c.name for c in m.calls]
    return run_guarded(body, tp, WAIT_S)


def _check_shard(impl, task, axis, split):
    @GRADE
    @given(tp=st.integers(1, 4), k=st.integers(1, 3), other=st.integers(1, 4), vector=st.booleans(),
           seed=st.integers(0, 9))
    @example(tp=1, k=1, other=1, vector=False, seed=0)
    def prop(tp, k, other, vector, seed):
        shape = (tp * k,) if vector else (tp * k, other) if axis == 0 else (other, tp * k)
        w = np.random.default_rng(seed).standard_normal(shape)
        for r in range(tp):
            _close(untouched(getattr(impl, task))(w, r, tp), split(w, r, tp),
                   f"{task}(w of shape {shape}, rank {r}, tp {tp})", exact=True)
    prop()


def check_shard_columns(impl):
    _check_shard(impl, "shard_columns", -1, S.split_columns)


def check_shard_rows(impl):
    _check_shard(impl, "shard_rows", 0, S.split_rows)


def check_column_parallel_forward(impl):
    @GRADE
    @given(layer=layers())
    @example(layer=SMALL)
    def prop(layer):
        tp, x, w, b = layer
        out = _on_ranks(tp, lambda c: untouched(impl.column_parallel_forward)(
            c, x, S.split_columns(w, c.rank, tp), S.split_columns(b, c.rank, tp)))
        want = x @ w + b
        for r, (y, msgs, calls) in enumerate(out):
            what = f"rank {r} of tp={tp}, x {x.shape}, w {w.shape}"
            _close(y, S.split_columns(want, r, tp), what)
            assert msgs == 0 and not calls, f"{what}: sent {msgs} messages, {calls}; it needs none"
    no_hang(prop)


def check_row_parallel_forward(impl):
    @GRADE
    @given(layer=layers())
    @example(layer=SMALL)
    def prop(layer):
        tp, x, w, b = layer
        out = _on_ranks(tp, lambda c: untouched(impl.row_parallel_forward)(
            c, S.split_columns(x, c.rank, tp), S.split_rows(w, c.rank, tp), b))
        want = x @ w + b
        for r, (y, _, calls) in enumerate(out):
            what = f"rank {r} of tp={tp}, x {x.shape}, w {w.shape}"
            _close(y, want, what)
            ok = len(calls) == 1 and calls[0].endswith("all_reduce") or tp == 1 and not calls
            assert ok, f"{what}: collectives {calls}; row parallel needs exactly one all-reduce"
    no_hang(prop)


def _serial_cross_entropy(logits, targets):
    """The formula written out: mean_i(logsumexp(logits_i) - logits_i[t_i]) and its gradient."""
    m = logits.max(axis=1, keepdims=True)
    e = np.exp(logits - m)
    lse = np.log(e.sum(axis=1)) + m[:, 0]
    n = len(targets)
    loss = float(np.mean(lse - logits[np.arange(n), targets]))
    grad = e / e.sum(axis=1, keepdims=True)
    grad[np.arange(n), targets] -= 1.0
    return loss, grad / n


def check_vocab_parallel_cross_entropy(impl):
    @GRADE
    @given(tp=st.integers(1, 4), n=st.integers(1, 6), k=st.integers(4, 6), big=st.booleans(),
           seed=st.integers(0, 9))
    @example(tp=2, n=3, k=4, big=False, seed=0)
    @example(tp=2, n=2, k=4, big=True, seed=1)  # logits near 1000: exp overflows without the max
    def prop(tp, n, k, big, seed):
        rng = np.random.default_rng(seed)
        v = tp * k
        logits = rng.standard_normal((n, v)) * 3 + (1000.0 if big else 0.0)
        targets = rng.integers(0, v, n)
        want, want_grad = _serial_cross_entropy(logits, targets)
        out = _on_ranks(tp, lambda c: untouched(impl.vocab_parallel_cross_entropy)(
            c, S.split_columns(logits, c.rank, tp), targets.copy()))
        for r, ((loss, grad), _, calls) in enumerate(out):
            what = f"rank {r} of tp={tp}, logits ({n}, {v}) float64{' near 1000' if big else ''}"
            assert np.isfinite(loss), f"{what}: loss {loss} (subtract the row maximum before exp)"
            assert abs(float(loss) - want) <= 1e-9 * max(1.0, abs(want)), \
                f"{what}: loss {float(loss)!r}, expected {want!r} (is each target logit counted once?)"
            assert_close(grad, S.split_columns(want_grad, r, tp), f"{what}, grad_shard",
                         rtol=1e-8, atol=1e-12)
            gathers = [c for c in calls if "gather" in c]
            assert not gathers, f"{what}: {gathers}: the point is never to gather the (N, V) logits"
    no_hang(prop)
    _check_vocab_parallel_bytes(impl)


def _check_vocab_parallel_bytes(impl):
    @GRADE
    @given(tp=st.integers(2, 4), n=st.integers(1, 5), seed=st.integers(0, 9))
    def prop(tp, n, seed):
        rng = np.random.default_rng(seed)
        v = tp * 8
        logits, targets = rng.standard_normal((n, v)), rng.integers(0, v, n)

        def body(comm):
            with measure(comm) as m:
                ce = untouched(impl.vocab_parallel_cross_entropy)
                ce(comm, S.split_columns(logits, comm.rank, tp), targets)
            return m.bytes_sent
        limit = 3 * 2 * n * 8  # three all-reduces of N float64s: each sends < 2N·8 bytes per rank
        for r, sent in enumerate(run_guarded(body, tp, WAIT_S)):
            assert sent <= limit, (f"rank {r} of tp={tp}, logits ({n}, {v}): sent {sent} bytes; three "
                                   f"all-reduces of N={n} numbers send at most {limit} (no logits travel)")
    no_hang(prop)


CHECKS = {"shard_columns": check_shard_columns, "shard_rows": check_shard_rows,
          "column_parallel_forward": check_column_parallel_forward,
          "row_parallel_forward": check_row_parallel_forward,
          "vocab_parallel_cross_entropy": check_vocab_parallel_cross_entropy}
POINTS = {"shard_columns": 1, "shard_rows": 1, "column_parallel_forward": 2, "row_parallel_forward": 2,
          "vocab_parallel_cross_entropy": 4}


# -- minidist's own implementation (must pass) ---------------------------------------------------

def reference():
    """The library's layers with their weights set to the given shards."""
    def column_parallel_forward(comm, x, w_shard, b_shard):
        layer = T.ColumnParallelLinear(w_shard.shape[0], w_shard.shape[1] * comm.size, comm, dtype=np.float64)
        layer.weight.data, layer.bias.data = w_shard, b_shard
        return layer(Tensor(x)).numpy()

    def row_parallel_forward(comm, x_shard, w_shard, b):
        layer = T.RowParallelLinear(w_shard.shape[0] * comm.size, w_shard.shape[1], comm, dtype=np.float64)
        layer.weight.data, layer.bias.data = w_shard, b
        return layer(Tensor(x_shard)).numpy()

    def vocab_parallel_cross_entropy(comm, logits_shard, targets):
        x = Tensor(logits_shard, requires_grad=True)
        loss = V.vocab_parallel_cross_entropy(x, targets, comm)
        loss.backward()
        return float(loss.numpy()), x.grad

    return types.SimpleNamespace(shard_columns=S.split_columns, shard_rows=S.split_rows,
                                 column_parallel_forward=column_parallel_forward,
                                 row_parallel_forward=row_parallel_forward,
                                 vocab_parallel_cross_entropy=vocab_parallel_cross_entropy)


# -- deliberately broken implementations (must fail) ---------------------------------------------

def _interleaved_columns(w, rank, tp):  # every tp-th column: right shape, wrong block
    return w[..., rank::tp]


def _rows_for_columns(w, rank, tp):  # wrong shard axis (written as a student would)
    n = w.shape[0] // tp
    return w[rank * n:(rank + 1) * n]


def _columns_for_rows(w, rank, tp):  # wrong shard axis
    n = w.shape[-1] // tp
    return w[..., rank * n:(rank + 1) * n]


def _column_all_reduces_input(comm, x, w_shard, b_shard):  # right answer, needless communication
    return all_reduce(comm, x) / comm.size @ w_shard + b_shard


def _row_bias_before_reduce(comm, x_shard, w_shard, b):  # every rank adds b: the sum has tp copies
    return all_reduce(comm, x_shard @ w_shard + b)


def _row_reduce_on_rank_0_only(comm, x_shard, w_shard, b):  # the other ranks never join: a hang
    y = x_shard @ w_shard
    return (all_reduce(comm, y) if comm.rank == 0 else y) + b


def _row_without_reduce(comm, x_shard, w_shard, b):  # a partial product is not the output
    return x_shard @ w_shard + b


def _ce_gathers_logits(comm, logits_shard, targets):  # right numbers, but all (N, V) logits travel
    logits = all_gather(comm, logits_shard, axis=1)
    loss, grad = _serial_cross_entropy(logits, targets)
    return loss, S.split_columns(grad, comm.rank, comm.size)


def _ce_parts(comm, logits_shard, targets, subtract_max=True, mask=True, divide=True):
    n, vl = logits_shard.shape
    lo = comm.rank * vl
    m = all_reduce(comm, logits_shard.max(axis=1), op="max") if subtract_max else np.zeros(n)
    e = np.exp(logits_shard - m[:, None])
    total = all_reduce(comm, e.sum(axis=1))
    local = targets - lo
    mine = (local >= 0) & (local < vl) if mask else np.ones(n, bool)
    idx = np.clip(local, 0, vl - 1)
    t = np.where(mine, logits_shard[np.arange(n), idx], 0.0)
    t = all_reduce(comm, t)
    loss = float(np.mean(np.log(total) + m - t))
    grad = e / total[:, None]
    grad[np.arange(n)[mine], idx[mine]] -= 1.0
    return loss, grad / n if divide else grad


def _ce_no_max(comm, logits_shard, targets):  # exp(1000) overflows: inf / inf
    with np.errstate(all="ignore"):
        return _ce_parts(comm, logits_shard, targets, subtract_max=False)


def _ce_unmasked_target(comm, logits_shard, targets):  # every rank adds "its" target logit (clipped)
    return _ce_parts(comm, logits_shard, targets, mask=False)


def _ce_grad_not_mean(comm, logits_shard, targets):  # gradient of the sum, not of the mean
    return _ce_parts(comm, logits_shard, targets, divide=False)


def _ce_shifts_logits_in_place(comm, logits_shard, targets):  # right loss and gradient, but subtracts
    m = all_reduce(comm, logits_shard.max(axis=1), op="max")     # the row max from the caller's logits
    logits_shard -= m[:, None]
    return reference().vocab_parallel_cross_entropy(comm, logits_shard, targets)


BROKEN = {"shard_columns": [_interleaved_columns, _rows_for_columns], "shard_rows": [_columns_for_rows],
          "column_parallel_forward": [_column_all_reduces_input],
          "row_parallel_forward": [_row_bias_before_reduce, _row_without_reduce],
          "vocab_parallel_cross_entropy": [_ce_no_max, _ce_unmasked_target, _ce_grad_not_mean,
                                           _ce_gathers_logits, _ce_shifts_logits_in_place]}
HANGS = {"row_parallel_forward": _row_reduce_on_rank_0_only}
