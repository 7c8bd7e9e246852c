"""Communication hooks (minidist.parallel.data.compress): error feedback loses nothing, k = all and full rank
equal the dense sum, QSGD is unbiased, every replica gets the same bits, and the ledger's bytes equal
each method's formula -- written out here, not taken from the hooks."""

import math
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist.comm import measure, run
from minidist.nn import GPT, GPTConfig, optim
from minidist.parallel.data.compress import (
    CastState,
    PowerSGDState,
    QSGDState,
    SignState,
    SparseState,
    cast_hook,
    ef_sparsify,
    make_hook,
    orthogonalize,
    powersgd_hook,
    qsgd_decode,
    qsgd_encode,
    qsgd_hook,
    reduce_with_hook,
    sign_hook,
    sparse_hook,
)
from minidist.parallel.data.compress.sign import sign_compress
from minidist.parallel.data.ddp import DDP
from tests.conftest import budget


def rank_data(p, shapes, seed, dtype=np.float64):
    """Per rank, one flat gradient of a bucket of ``shapes``."""
    rng = np.random.default_rng(seed)
    n = sum(int(np.prod(s)) for s in shapes)
    return [rng.standard_normal(n).astype(dtype) for _ in range(p)]


def serial_sum(grads):
    """Σ_r in rank order, starting from rank 0 (what a sparse sum adds up to)."""
    out = grads[0].copy()
    for g in grads[1:]:
        out = out + g
    return out


def run_hook(p, state_fn, hook, grads, shapes, steps=1):
    """Each rank: ``steps`` calls of the hook on its gradient; returns per rank the list of results."""
    def body(comm):
        state = state_fn()
        return [reduce_with_hook(comm, state, hook, grads[comm.rank].copy(), shapes) for _ in range(steps)]
    return run(body, ranks=p)


# -- error feedback loses nothing -------------------------------------------------------------------

@given(n=st.integers(1, 40), k=st.integers(1, 40), seed=st.integers(0, 99), with_res=st.booleans())
def test_sparse_error_feedback_loses_nothing_exactly(n, k, seed, with_res):
    rng = np.random.default_rng(seed)
    g = rng.standard_normal(n).astype(np.float32)
    res = rng.standard_normal(n).astype(np.float32) if with_res else None
    idx, values, new_res = ef_sparsify(g, res, min(k, n))
    sent = np.zeros(n, np.float32)
    sent[idx] = values
    want = g + res if with_res else g
    assert len(set(idx.tolist())) == min(k, n)
    np.testing.assert_array_equal(sent + new_res, want)  # exactly: disjoint supports
    kept = np.sort(np.abs(want))[::-1][:min(k, n)]       # top-k: the largest magnitudes were sent
    np.testing.assert_array_equal(np.sort(np.abs(values))[::-1], kept)


@given(n=st.integers(1, 40), seed=st.integers(0, 99))
def test_sign_error_feedback_sent_plus_residual_is_the_input(n, seed):
    rng = np.random.default_rng(seed)
    m = rng.standard_normal(n)
    _, sent = sign_compress(m)
    scale = np.mean(np.abs(m))
    np.testing.assert_array_equal(sent, np.where(m >= 0, scale, -scale))
    residual = m - sent
    np.testing.assert_allclose(sent + residual, m, rtol=0, atol=4 * np.finfo(float).eps * np.abs(m).max())


@given(p=st.integers(1, 3), seed=st.integers(0, 50))
@budget(6)
def test_hooks_with_error_feedback_lose_nothing_over_ranks(p, seed):
    """Over two steps: Σ_r (gradient_r + old residual_r) == what the ranks received + Σ_r new residual_r
    (PowerSGD's residual is each rank's share of what its rank-1 approximation missed)."""
    shapes = [(5, 4), (3,)]
    grads = rank_data(p, shapes, seed)
    # (top-k is exact per rank, above; over ranks the sums run in another order)
    for state_fn, hook, tol in [(lambda: SparseState("topk", 0.2), sparse_hook, 1e-14),
                                (lambda: SignState(), sign_hook, 1e-12),
                                (lambda: PowerSGDState(rank=1), powersgd_hook, 1e-12)]:
        def body(comm, state_fn=state_fn, hook=hook):
            state = state_fn()
            g = grads[comm.rank]
            reduce_with_hook(comm, state, hook, g.copy(), shapes)
            old = state.residuals[0].copy()
            got = reduce_with_hook(comm, state, hook, g.copy(), shapes)
            return old, got, state.residuals[0]
        out = run(body, ranks=p)
        want = serial_sum([g + o for g, (o, _, _) in zip(grads, out)])
        have = out[0][1] + serial_sum([r for _, _, r in out])
        np.testing.assert_allclose(have, want, rtol=0, atol=tol * max(1, np.abs(want).max()))


# -- equal to dense at the limit ----------------------------------------------------------------------

@given(p=st.integers(1, 4), n=st.integers(1, 30), seed=st.integers(0, 99))
def test_topk_with_k_all_is_the_dense_sum(p, n, seed):
    grads = rank_data(p, [(n,)], seed)
    out = run_hook(p, lambda: SparseState("topk", 1.0), sparse_hook, grads, [(n,)])
    for r in range(p):
        np.testing.assert_array_equal(out[r][0], serial_sum(grads))


@given(p=st.integers(1, 3), n=st.integers(1, 6), m=st.integers(1, 6), seed=st.integers(0, 99))
def test_powersgd_with_full_rank_is_the_dense_sum(p, n, m, seed):
    shapes = [(n, m), (2,), (m, 1, n)]
    grads = rank_data(p, shapes, seed)
    out = run_hook(p, lambda: PowerSGDState(rank=max(n, m)), powersgd_hook, grads, shapes)
    for r in range(p):
        np.testing.assert_allclose(out[r][0], serial_sum(grads), rtol=1e-9, atol=1e-9)


def test_gram_schmidt_zeroes_zero_and_dependent_columns_and_the_rest_are_orthonormal():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((6, 1)), rng.standard_normal((6, 1))
    P = np.concatenate([a, 2 * a, np.zeros((6, 1)), b], axis=1)  # a dependent column, a zero column
    Q = orthogonalize(P.copy())
    assert np.isfinite(Q).all()  # a plain Gram-Schmidt divides 0 by 0 here
    np.testing.assert_array_equal(Q[:, 1:3], 0)
    live = Q[:, [0, 3]]
    np.testing.assert_allclose(live.T @ live, np.eye(2), atol=1e-12)
    np.testing.assert_allclose(Q[:, 0], a[:, 0] / np.linalg.norm(a), atol=1e-12)  # same first direction


# -- QSGD is unbiased ----------------------------------------------------------------------------------

@pytest.mark.parametrize("s", [1, 7])
def test_qsgd_is_unbiased(s):
    """T draws with a fixed seed: the mean decoded vector is within 5 standard errors of v, entrywise.
    Each entry's variance is at most (norm/s)²/4, so the mean's standard error is norm/(2 s √T)."""
    rng, T = np.random.default_rng(1), 3000
    v = np.random.default_rng(2).standard_normal(20)
    mean = np.zeros_like(v)
    for _ in range(T):
        mean += qsgd_decode(qsgd_encode(v, s, rng), v.size, s, v.dtype)
    mean /= T
    bound = 5 * np.linalg.norm(v) / (2 * s * math.sqrt(T))
    assert np.abs(mean - v).max() < bound, (np.abs(mean - v).max(), bound)
    assert np.abs(mean - v).max() > 0  # it is random rounding, not the identity


def test_qsgd_codes_round_trip_and_take_the_bits_of_the_formula():
    rng = np.random.default_rng(0)
    v = np.array([0.0, -1.0, 0.5, 3.0], np.float32)
    msg = qsgd_encode(v, 7, rng)  # 1 sign bit + 3 level bits, then the float32 norm
    assert msg.size == math.ceil(4 * 4 / 8) + 4
    out = qsgd_decode(msg, 4, 7, np.float32)
    norm = np.float32(np.linalg.norm(v))
    assert out[0] == 0 and out[1] < 0 and out[3] > 0
    np.testing.assert_allclose(np.abs(out) * 7 / norm, np.round(np.abs(out) * 7 / norm), atol=1e-5)  # levels


# -- every replica gets the same bits; bytes equal the formulas ----------------------------------------

def ring_bytes(n, p, r, itemsize):
    """Rank r's bytes in a ring all-reduce of n elements: every chunk but its own, then all but r+1."""
    if p == 1:
        return 0
    c = [len(a) for a in np.array_split(np.arange(n), p)]
    return itemsize * (2 * n - c[r] - c[(r + 1) % p])


def formulas(n, p, r, shapes, itemsize=8):
    k = math.ceil(0.25 * n)
    nr = sum(s[0] * 2 for s in shapes if len(s) > 1)
    mr = sum(int(np.prod(s[1:])) * 2 for s in shapes if len(s) > 1)
    vec = sum(s[0] for s in shapes if len(s) == 1)
    return {"dense": ring_bytes(n, p, r, itemsize),
            "bf16": ring_bytes(n, p, r, 2),
            "topk": (p - 1) * k * (4 + itemsize),
            "randk": (p - 1) * k * (4 + itemsize),
            "qsgd": (p - 1) * (math.ceil(n * 4 / 8) + itemsize),     # s = 7: 4 bits per entry
            "sign": (p - 1) * (math.ceil(n / 8) + itemsize),
            "powersgd": ring_bytes(nr + vec, p, r, itemsize) + ring_bytes(mr, p, r, itemsize)}


HOOKS = {"dense": {}, "bf16": {}, "topk": {"ratio": 0.25}, "randk": {"ratio": 0.25}, "qsgd": {"levels": 7},
         "sign": {}, "powersgd": {"rank": 2}}


@given(p=st.integers(1, 4), a=st.integers(3, 7), b=st.integers(3, 9), seed=st.integers(0, 99))
@budget(6)
def test_every_hook_keeps_replicas_identical_and_sends_its_formula(p, a, b, seed):
    shapes = [(a, b), (b,), (2, a, 2)]
    n = a * b + b + 4 * a
    grads = rank_data(p, shapes, seed)

    def body(comm):
        out = {}
        for name, kw in HOOKS.items():
            state, hook = make_hook(name, **kw)
            results, sent = [], []
            for _ in range(2):  # the second step runs on the residuals / warm-started Q
                with measure(comm) as m:
                    results.append(reduce_with_hook(comm, state, hook, grads[comm.rank].copy(), shapes))
                sent.append(m.bytes_sent)
            out[name] = results, sent
        return out
    out = run(body, ranks=p)
    for name in HOOKS:
        for r in range(p):
            for step in range(2):
                np.testing.assert_array_equal(out[r][name][0][step], out[0][name][0][step],
                                              err_msg=f"{name}: rank {r} differs from rank 0")
            want = formulas(n, p, r, shapes)[name]
            assert out[r][name][1] == [want, want], \
                f"{name} rank {r} of {p}: sent {out[r][name][1]}, formula {want}"
        approx = out[0][name][0][0]
        err = np.linalg.norm(approx - serial_sum(grads)) / np.linalg.norm(serial_sum(grads))
        assert err < (0.02 if name == "bf16" else 1e-12 if name == "dense" else 2.0), (name, err)


def test_bf16_hook_is_the_mixed_precision_arithmetic():
    """The hook pre-divides by p and sums in bf16; cast up and times p: the sum, to bf16 rounding."""
    grads = rank_data(2, [(64,)], 0, np.float32)
    out = run_hook(2, lambda: CastState("bf16"), cast_hook, grads, [(64,)])
    np.testing.assert_allclose(out[0][0], grads[0] + grads[1], rtol=2e-2, atol=2e-2)
    assert out[0][0].dtype == np.float32


def test_powersgd_start_iter_sends_dense_first():
    shapes = [(8, 8)]
    grads = rank_data(2, shapes, 3)

    def body(comm):
        state, sent = PowerSGDState(rank=1, start_iter=2), []
        for _ in range(3):
            with measure(comm) as m:
                reduce_with_hook(comm, state, powersgd_hook, grads[comm.rank].copy(), shapes)
            sent.append(m.bytes_sent)
        return sent
    dense, low = ring_bytes(64, 2, 0, 8), 2 * ring_bytes(8, 2, 0, 8)
    assert run(body, ranks=2)[0] == [dense, dense, low]


def test_qsgd_hook_ranks_round_independently():
    grads = [np.full(50, 0.5)] * 2  # same gradient: different rounding per rank
    def body(comm):
        state = QSGDState(levels=1)
        state.rng = np.random.default_rng([0, comm.rank])
        from minidist.parallel.data.compress.qsgd import qsgd_encode as enc
        return enc(grads[comm.rank], 1, np.random.default_rng([0, comm.rank]))
    a, b = run(body, ranks=2)
    assert not np.array_equal(a, b)
    out = run_hook(2, QSGDState, qsgd_hook, grads, [(50,)])
    np.testing.assert_array_equal(out[0][0], out[1][0])



def _qsgd_by_hand(v, s, u):
    """QSGD's quantizer written from the paper: level = floor(|v|/‖v‖·s) + [u < frac], value =
    ‖v‖·sign(v)·level/s; ``u`` are the uniform draws (float32, one per entry)."""
    norm = np.sqrt(np.sum(v * v))
    scaled = np.abs(v) / norm * s
    level = np.floor(scaled) + (u < scaled - np.floor(scaled))
    return norm * np.sign(v) * level / s


@pytest.mark.parametrize("p,seed", [(2, 0), (3, 5)])
def test_qsgd_hook_draws_each_ranks_rounding_from_seed_and_rank_across_steps(p, seed):
    """The hook's sum over 2 steps == Σ_r quantize(g_r) with rank r's draws from
    default_rng([seed, r]), continued from step to step: equal gradients round differently on each
    rank (a generator seeded without the rank gives p times one rank's rounding)."""
    n, s = 64, 3
    g = np.random.default_rng(7).standard_normal(n)
    out = run_hook(p, lambda: QSGDState(levels=s, seed=seed), qsgd_hook, [g] * p, [(n,)], steps=2)
    gens = [np.random.default_rng([seed, r]) for r in range(p)]
    for step in range(2):
        want = sum(_qsgd_by_hand(g, s, gen.random(n, dtype=np.float32)) for gen in gens)
        for r in range(p):
            np.testing.assert_allclose(out[r][step], want, rtol=1e-12, atol=1e-12)

# -- through DDP --------------------------------------------------------------------------------------

CFG = GPTConfig(vocab_size=11, block_size=6, n_layer=1, n_head=2, d_model=8, dtype="float64")


def ddp_train(p, hook_name=None, steps=2, **kw):
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 11, (2 * p, 5)), rng.integers(0, 11, (2 * p, 5))) for _ in range(steps)]

    def body(comm):
        model = GPT(CFG)
        ddp = DDP(model, comm, bucket_bytes=2000)
        if hook_name:
            ddp.register_comm_hook(*make_hook(hook_name, **kw))
        opt = optim.SGD(model.parameters(), lr=0.1)
        for x, y in batches:
            sl = slice(2 * comm.rank, 2 * comm.rank + 2)
            ddp.backward(model.loss(x[sl], y[sl]))
            ddp.wait_gradients()
            opt.step()
            opt.zero_grad()
        return {n: np.array(q.data) for n, q in model.named_parameters()}
    return run(body, ranks=p)


def test_ddp_with_a_full_rank_powersgd_hook_trains_as_without():
    dense, low = ddp_train(2), ddp_train(2, "powersgd", rank=64)
    for name in dense[0]:
        np.testing.assert_allclose(low[0][name], dense[0][name], rtol=1e-9, atol=1e-10, err_msg=name)


@pytest.mark.parametrize("name,kw", [("topk", {"ratio": 0.05}), ("sign", {}), ("qsgd", {"levels": 3})])
def test_ddp_with_a_lossy_hook_keeps_replicas_identical(name, kw):
    out = ddp_train(3, name, **kw)
    for r in range(1, 3):
        for key in out[0]:
            np.testing.assert_array_equal(out[r][key], out[0][key], err_msg=f"{name}: {key} on rank {r}")


def test_register_comm_hook_twice_is_an_error():
    def body(comm):
        ddp = DDP(GPT(CFG), comm)
        ddp.register_comm_hook(*make_hook("bf16"))
        with pytest.raises(RuntimeError, match="once"):
            ddp.register_comm_hook(*make_hook("bf16"))
    run(body, ranks=1)


def test_unknown_hook_name_is_an_error():
    with pytest.raises(ValueError, match="powersgd"):
        make_hook("powerSGD")


def test_train_3d_takes_a_hook_for_its_data_parallel_part():
    """dp=2 x pp=2: a full-rank PowerSGD hook trains as the plain all-reduce."""
    from minidist.parallel.three_d import train_3d

    cfg = CFG.replace(n_layer=2)
    rng = np.random.default_rng(0)
    data = [(rng.integers(0, 11, (4, 5)), rng.integers(0, 11, (4, 5))) for _ in range(2)]

    def body(comm, hook):
        res = train_3d(comm, cfg, data, dp=2, pp=2, microbatches=2,
                       comm_hook=hook and make_hook(hook[0], **hook[1]))
        return [np.array(q.data) for q in res.stage.parameters()], res.losses
    plain = run(lambda c: body(c, None), ranks=4)
    full = run(lambda c: body(c, ("powersgd", {"rank": 64})), ranks=4)
    for (a, la), (b, lb) in zip(plain, full):
        np.testing.assert_allclose(lb, la, rtol=1e-9)
        for x, y in zip(a, b):  # Gram-Schmidt on a nearly rank-deficient P: ~1e-10 off, not 1e-16
            np.testing.assert_allclose(y, x, rtol=1e-7, atol=1e-8)


def test_the_lesson_runs_every_method_and_its_checks_pass(capsys, monkeypatch):
    """A tiny run of lesson 12 (all methods, 2 ranks, a fast emulated link): every check PASSes, and
    each method's progress line is out before the next method starts training."""
    from minidist.comm.transports.link import current_link, set_link
    from minidist.lessons import compression as lesson

    printed, seen_at_start = [], {}
    real_train = lesson.train

    def train(comm, args, name, *a):
        if comm.rank == 0:
            printed.append(capsys.readouterr().out)
            seen_at_start[name] = "".join(printed)
        return real_train(comm, args, name, *a)
    monkeypatch.setattr(lesson, "train", train)
    before = current_link()
    try:
        lesson.main(["--ranks", "2", "--steps", "4", "--d-model", "16", "--layers", "1", "--seq", "8",
                     "--link", "alpha_us=1,gbps=100", "--methods", *lesson.METHODS])
    finally:
        set_link(before)
    out = "".join(printed) + capsys.readouterr().out
    assert out.count("PASS") == len(lesson.METHODS) and "FAIL" not in out, out
    assert "link: alpha_us=1,gbps=100" in out
    # a line per method as it finishes, in order (a slow GPU run shows its progress)
    progress = [line.split("]")[1].split(" 4 steps in ")[0].strip() for line in out.splitlines()
                if line.startswith("  [")]
    assert progress == list(lesson.METHODS), out
    names = list(lesson.METHODS)
    for prev, name in zip(names, names[1:]):
        assert f"] {prev} " in seen_at_start[name], (prev, name, seen_at_start[name])


def test_the_lessons_step_clock_waits_for_the_device(monkeypatch):
    """On a GPU a step's kernels are still queued when the host is done with it: the step time the
    lesson reports must include waiting for them. A backend whose synchronize takes 0.2 s stands in
    for that queued work."""
    from minidist.accel.backend import Backend
    from minidist.lessons import compression as lesson

    monkeypatch.setattr(Backend, "synchronize", lambda self: time.sleep(0.2))
    args = lesson.parser().parse_args(["--steps", "3", "--d-model", "16", "--layers", "1", "--seq", "8"])

    def body(comm):
        batches, held_out = lesson.data(args, comm.size)
        return lesson.train(comm, args, "dense", batches, held_out)
    for r in run(body, ranks=2):
        assert r["step_s"] >= 0.2 and r["first_s"] >= 0.2, r


def test_the_lesson_refuses_a_bad_link_and_has_help():
    from minidist.lessons import compression as lesson

    assert "top-k 1% + EF" in lesson.parser().format_help()
    with pytest.raises(SystemExit):
        lesson.main(["--ranks", "2", "--link", "gbps=fast"])


def test_the_lesson_exits_1_when_bytes_miss_the_formula(monkeypatch, capsys):
    from minidist.comm.transports.link import current_link, set_link
    from minidist.lessons import compression as lesson

    real = lesson.step_formula
    monkeypatch.setattr(lesson, "step_formula", lambda hook, *a, **k: real(hook, *a, **k) + (hook == "topk"))
    before = current_link()
    try:
        with pytest.raises(SystemExit) as info:
            lesson.main(["--ranks", "2", "--steps", "2", "--d-model", "16", "--layers", "1", "--seq", "8",
                         "--link", "off", "--methods", "dense", "top-k 1% + EF"])
    finally:
        set_link(before)
    assert info.value.code == 1
    assert "bytes != formula, replicas identical: FAIL" in capsys.readouterr().out


@pytest.mark.parametrize("backend", ["jax", pytest.param("cupy", marks=pytest.mark.gpu)])
def test_hooks_run_on_a_device_backend_through_host_copies(backend):
    """A device gradient goes to the host hook and comes back a device array, with the host's sum."""
    from minidist.accel.backend import get_backend

    if backend == "jax":
        pytest.importorskip("jax")
    grads = rank_data(2, [(3, 4)], 5)

    def body(comm):
        be = get_backend(backend)
        out = {}
        for name, kw in [("topk", {"ratio": 1.0}), ("powersgd", {"rank": 3})]:
            state, hook = make_hook(name, **kw)
            y = reduce_with_hook(comm, state, hook, be.from_host(grads[comm.rank]), [(3, 4)])
            assert backend_of_name(y) == backend
            out[name] = np.asarray(be.to_host(y))
        return out
    for out in run(body, ranks=2, backend=backend):
        np.testing.assert_array_equal(out["topk"], grads[0] + grads[1])
        np.testing.assert_allclose(out["powersgd"], grads[0] + grads[1], rtol=1e-9, atol=1e-9)


def backend_of_name(x) -> str:
    from minidist.accel.backend import backend_of

    return backend_of(x).name


def test_random_k_draws_differ_across_ranks_and_repeat_per_seed_and_rank():
    """Random-k's indices come from a generator per (seed, rank): two ranks pick different entries (with
    k = 8 of 4096 a collision of all 8 is impossible in practice), the same rank with the same seed picks
    the same ones again, and another seed picks others."""
    m = np.arange(4096, dtype=np.float64)

    def pick(rank, seed=3, steps=2):
        state = SparseState("randk", ratio=8 / 4096, seed=seed)
        return [state.selector(rank)(m, state.k(m.size)).tolist() for _ in range(steps)]

    r0, r1 = pick(0), pick(1)
    assert r0 != r1 and r0[0] != r1[0] and r0[1] != r1[1]
    assert pick(0) == r0 and pick(1) == r1
    assert pick(0, seed=4) != r0
    assert r0[0] != r0[1]  # a fresh draw every step, not the same indices forever
    assert all(len(set(ix)) == 8 and ix == sorted(ix) for ix in r0 + r1)


def test_powersgd_fresh_q_is_drawn_per_matrix_and_the_same_on_every_rank():
    """Q's random start comes from a generator per (seed, bucket, matrix): two matrices of one bucket (or
    one matrix in two buckets) start from different Q, and two ranks' states with the same seed draw the
    same Q (no rank in the seed: the two all-reduces need every rank's P and Q built on the same Q)."""
    def q(state, bucket, j):
        return state.fresh_q(bucket, j, np.zeros((6, 2))).copy()

    a, b = PowerSGDState(rank=2, seed=5), PowerSGDState(rank=2, seed=5)
    q00, q01, q10 = q(a, 0, 0), q(a, 0, 1), q(a, 1, 0)
    assert not np.array_equal(q00, q01) and not np.array_equal(q00, q10) and not np.array_equal(q01, q10)
    np.testing.assert_array_equal(q(b, 0, 0), q00)
    np.testing.assert_array_equal(q(b, 0, 1), q01)
    assert not np.array_equal(q(PowerSGDState(rank=2, seed=6), 0, 0), q00)
    kept = np.ones((6, 2))
    np.testing.assert_array_equal(a.fresh_q(0, 0, kept.copy()), kept)  # live columns are not redrawn
