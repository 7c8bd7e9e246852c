"""``parallelize`` over random small meshes with random techniques equals the serial twin; its
refusals name both techniques; experts stay out of DDP by its ``ignore=`` rule; collective matmul,
the context-parallel mode and FP8 reach the model and train as without them (or as the FP8 twin).

The twin (``_serial``): one GPT, the whole global batch, the same optimizer, in the same precision
(``MixedPrecision`` over the whole model). Tolerances as ``test_compose``: float64 1e-9 (only the
summation order differs); bf16 / fp16 the fp32 masters to ``LOW_TOL`` (the parallel run rounds
partial sums -- per rank, per microbatch, row-parallel products -- where the twin rounds once),
with AdamW (``offload``) at most ``ADAM_STEPS`` x lr.
"""

import types

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from minidist.comm import Mesh, run
from minidist.nn import GPT, GPTConfig
from minidist.nn.optim import make_optimizer
from minidist.parallel.experts.model import moe_gpt
from minidist.parallel.experts.serial import train_serial_moe
from minidist.parallel.memory.fp8 import Fp8Recipe
from minidist.parallel.memory.precision import DynamicLossScaler, MixedPrecision
from minidist.parallel.parallelize import Options, check, parallelize, techniques
from minidist.parallel.three_d import gather_full_state, max_state_diff, train_3d
from tests.conftest import budget

CFG = GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, d_model=8, dtype="float64")
TOL = 1e-9
LOW_TOL = {"bf16": 5e-3, "fp16": 5e-4}
LOSS_SCALE = 2.0 ** 8
ADAM_STEPS = 4  # AdamW moves a weight ~lr whatever its gradient's size: a rounding that flips a
#                 near-zero gradient's sign moves it by up to 2 lr, over 2 steps 4 lr


def _batches(rows, steps=2, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        y = rng.integers(0, 16, (rows, 8))
        y = np.where(rng.random(y.shape) < 0.2, -1, y)  # ignored targets, spread unevenly
        out.append((rng.integers(0, 16, (rows, 8)), y))
    return out


def _cfg(precision):
    return CFG if precision is None else CFG.replace(dtype="float32")


def _serial(batches, precision, optimizer, lr, moe=None, cfg=None):
    """The serial twin: {name: fp64 array} of the trained (master) parameters, and the losses."""
    model = GPT(cfg or _cfg(precision))
    if moe is not None:
        moe_gpt(model, **moe)
    scaler = DynamicLossScaler(init_scale=LOSS_SCALE) if precision == "fp16" else None
    mp = MixedPrecision(model, precision, scaler=scaler) if precision else None
    params = mp.master_params if mp else model.parameters()
    opt = make_optimizer(optimizer, params, lr)
    losses = []
    for x, y in batches:
        loss = mp.loss(x, y) if mp else model.loss(x, y)
        losses.append(float(loss.data))
        if mp:
            mp.backward(loss)
            assert mp.step(opt)
        else:
            loss.backward()
            opt.step()
            opt.zero_grad()
    names = [n for n, _ in model.named_parameters()]
    return {n: np.asarray(p.data, np.float64) for n, p in zip(names, params)}, losses


def _rank(comm, batches, precision, **kw):
    res = train_3d(comm, _cfg(precision), batches, precision=precision, loss_scale=LOSS_SCALE, **kw)
    return gather_full_state(comm, res), res.losses


@given(dp=st.sampled_from([1, 2]), pp=st.sampled_from([1, 2]), tp=st.sampled_from([1, 2]),
       cp=st.sampled_from([1, 2]), m=st.integers(1, 2), zero=st.sampled_from([None, 1, 2, 3]),
       precision=st.sampled_from([None, "bf16", "fp16"]), offload=st.booleans(),
       recompute=st.sampled_from([None, "full", "selective"]), sp=st.booleans(), experts=st.booleans(),
       cp_mode=st.sampled_from(["ring", "ulysses"]), seed=st.integers(0, 9))
@budget(10)
@example(dp=2, pp=2, tp=2, cp=1, m=2, zero=None, precision="bf16", offload=True, recompute="full", sp=True,
         experts=False, cp_mode="ring", seed=0)
@example(dp=2, pp=1, tp=2, cp=2, m=2, zero=3, precision=None, offload=True, recompute="full", sp=False,
         experts=False, cp_mode="ring", seed=1)
@example(dp=2, pp=2, tp=1, cp=2, m=1, zero=None, precision="fp16", offload=False, recompute=None, sp=False,
         experts=True, cp_mode="ring", seed=2)
@example(dp=2, pp=2, tp=1, cp=2, m=2, zero=None, precision=None, offload=False, recompute="full", sp=False,
         experts=False, cp_mode="ulysses", seed=3)
def test_random_meshes_and_techniques_equal_serial(dp, pp, tp, cp, m, zero, precision, offload, recompute,
                                                   sp, experts, cp_mode, seed):
    """dp x pp x tp x cp <= 8 thread ranks; the draws the matrix refuses are made legal instead
    (experts, ep = dp of them, need DDP and no sequence parallelism; ZeRO
    no pipeline and full precision; selective recomputation and sequence parallelism no ring attention;
    Ulysses needs cp to divide each tp rank's heads, else the ring)."""
    moe = dict(n_experts=2, k=1, seed=seed) if experts else None
    if (CFG.n_head // tp) % cp:
        cp_mode = "ring"
    if experts:
        zero, sp = None, False
    if zero is not None:
        pp, precision = 1, None
    if cp > 1 and recompute == "selective":
        recompute = "full"
    optimizer, lr = ("adamw", 1e-2 if precision is None else 1e-3) if offload else ("sgd", 0.5)
    batches = _batches(dp * m, seed=seed)
    want, want_losses = _serial(batches, precision, optimizer, lr, moe)
    results = run(_rank, ranks=dp * pp * tp * cp, batches=batches, precision=precision, dp=dp, pp=pp, tp=tp,
                  cp=cp, ep=dp if experts else 1, moe=moe, microbatches=m, zero=zero, offload=offload,
                  recompute=recompute, sequence_parallel=sp and tp > 1 and cp == 1, optimizer=optimizer,
                  lr=lr, cp_mode=cp_mode)
    state, losses = results[0]
    tol = TOL if precision is None else max(LOW_TOL[precision], ADAM_STEPS * lr if offload else 0)
    assert max_state_diff(state, want) <= tol
    np.testing.assert_allclose(losses, want_losses, rtol=0, atol=tol)


def _cut(comm, batches, cfg, **kw):
    res = train_3d(comm, cfg, batches, **kw)
    return gather_full_state(comm, res), res.losses, res.bounds


@pytest.mark.parametrize("schedule, bounds", [
    ("1f1b", [(0, 4), (4, 8)]),  # 0.1 + 3 blocks | 3 blocks + 0.3
    ("zb_v", [(0, 3), (3, 4), (4, 6), (6, 8)]),  # rank 0: pieces 0 and 3 (3.4), rank 1: 1 and 2 (3.0)
])
def test_layer_costs_cut_the_ranks_of_the_schedules_placement_and_training_equals_serial(schedule, bounds):
    """Embedding 0.1, six blocks of 1, head 0.3: the cut balances each rank's pieces together (a V's
    rank 0 holds both ends), not each piece, and the unevenly cut pipeline trains as the twin."""
    cfg = CFG.replace(n_layer=6)
    costs = [0.1] + [1.0] * 6 + [0.3]
    batches = _batches(4)
    want, want_losses = _serial(batches, None, "sgd", 0.5, cfg=cfg)
    results = run(_cut, ranks=2, batches=batches, cfg=cfg, pp=2, microbatches=4, schedule=schedule,
                  layer_costs=costs, optimizer="sgd", lr=0.5)
    state, losses, got = results[0]
    assert got == bounds
    assert max_state_diff(state, want) <= TOL
    np.testing.assert_allclose(losses, want_losses, rtol=0, atol=TOL)


# -- refusals, before anything is built --------------------------------------------------------

def _refusal(comm, sizes, dtype="float64", **kw):
    try:
        parallelize(CFG.replace(dtype=dtype), Mesh(comm, **sizes), **kw)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("sizes,kw,words", [
    (dict(dp=2, pp=2), dict(zero=1), ("ZeRO-1", "pipeline (PP)", "run_schedule drives only DDP")),
    (dict(dp=2), dict(zero=3, precision="bf16"), ("ZeRO-3", "bf16 mixed precision", "fp32 masters")),
    (dict(dp=2), dict(offload=True), ("offload=True is OffloadedAdamW", "optimizer='adamw'")),
    (dict(dp=2), dict(precision="int8"), ("precision='int8'", "'bf16' or 'fp16'")),
    (dict(dp=2), dict(zero=4), ("zero=4", "ZeRO stage 1, 2 or 3")),
    (dict(dp=2), dict(zero=1, comm_hook=(None, None)), ("ZeRO-1", "a DDP comm hook", "comm_hook=None",
                                                        "use DDP")),
    (dict(dp=2), dict(optimizer="adam"), ("unknown optimizer 'adam'", "'sgd' or 'adamw'")),
    (dict(dp=2), dict(recompute="most"), ("recompute='most'", "selective")),
    (dict(dp=2), dict(schedule="2f2b"), ("unknown schedule '2f2b'", "1f1b")),
    (dict(dp=2), dict(zero=2, moe=dict(n_experts=2)), ("experts (MoE)", "ZeRO-2", "use DDP")),
    (dict(tp=2), dict(sequence_parallel=True, moe=dict(n_experts=2)), ("experts (MoE)", "sequence parallel")),
    (dict(tp=2), dict(collective_matmul=True), ("collective_matmul=True", "sequence_parallel=True")),
    (dict(tp=2), dict(collective_matmul=True, sequence_parallel=True, fp8=Fp8Recipe(), dtype="float32"),
     ("collective matmul", "FP8 training", "use one of them")),
    (dict(dp=2), dict(fp8=Fp8Recipe()), ("fp8 needs an fp32 model", "dtype='float32'")),
    (dict(dp=2), dict(fp8="block"), ("fp8='block'", "an Fp8Recipe")),
    (dict(dp=2), dict(cp_mode="zigzag"), ("cp_mode='zigzag'", "ring, ulysses, hybrid")),
])
def test_refusals_name_what_is_wrong(sizes, kw, words):
    msgs = run(_refusal, ranks=int(np.prod(list(sizes.values()))), sizes=sizes, **kw)
    for msg in msgs:
        assert msg is not None and all(w in msg for w in words), msg


def _built_refusal(comm):
    try:
        parallelize(GPT(CFG), Mesh(comm, tp=2))
    except ValueError as e:
        return str(e)


def test_a_built_model_cannot_be_tensor_parallel():
    assert "pass the GPTConfig, not a built GPT" in run(_built_refusal, ranks=2)[0]


def test_a_built_serial_gpt_is_parallelized_as_its_config():
    batches = _batches(4, seed=4)
    want, _ = _serial(batches, None, "sgd", 0.5)

    def body(comm):
        par = parallelize(GPT(CFG), Mesh(comm, dp=2, pp=2), microbatches=2, lr=0.5)
        for x, y in batches:
            par.step(x, y)
        return gather_full_state(comm, types.SimpleNamespace(mesh=par.mesh, parallel=par))
    assert max_state_diff(run(body, ranks=4)[0], want) <= TOL


def test_techniques_are_listed_in_parallelize_order():
    o = Options(dp=2, pp=2, tp=2, sequence_parallel=True, recompute="full", precision="bf16", offload=True,
                optimizer="adamw")
    assert techniques(o) == ["tp", "sp", "pp", "recompute-full", "bf16", "ddp", "offload"]
    assert Options.of(checkpoint="sqrt") == Options(recompute="sqrt")  # the old name still accepted


def test_flags_are_checked_once_before_any_rank_starts(monkeypatch):
    """An ``Options`` checked in ``main`` reaches every rank as it is: ``train_mesh`` and
    ``parallelize`` check it no more (the pipeline lesson's --microbatches once, not once a layer)."""
    import minidist.parallel.parallelize as P

    calls = []

    def counted(*args, **kw):
        calls.append(args)
        return real(*args, **kw)
    real = P.check_3d
    monkeypatch.setattr(P, "check_3d", counted)
    opts = check(Options(dp=2, pp=2, microbatches=2), CFG, 4, batch_size=4, seq_len=8)
    batches = _batches(4)
    want, want_losses = _serial(batches, None, "sgd", 0.1)
    state, losses = run(lambda comm: (lambda r: (gather_full_state(comm, r), r.losses))(
        train_3d(comm, CFG, batches, opts)), ranks=4)[0]
    assert len(calls) == 1
    assert max_state_diff(state, want) <= TOL
    with pytest.raises(TypeError, match="Options or flags, not both"):
        run(lambda comm: train_3d(comm, CFG, batches, opts, lr=0.5), ranks=4)


# -- experts: out of DDP by a declared rule --------------------------------------------------------

def _experts_and_ddp(comm):
    par = parallelize(CFG, Mesh(comm, dp=2, ep=2), moe=dict(n_experts=2, k=1))
    synced = {id(p) for p in par.dp.params}
    return (len(par.experts), sum(id(p) in synced for p in par.experts),
            all(p.requires_grad for p in par.experts), len(par.dp.params) + len(par.experts),
            len(par.stage.parameters()))


def test_experts_are_ignored_by_ddp_and_stay_trainable():
    for n_experts, in_ddp, trainable, counted, total in run(_experts_and_ddp, ranks=2):
        assert n_experts > 0 and in_ddp == 0 and trainable and counted == total


def test_expert_parallel_training_through_parallelize_equals_serial():
    moe = dict(n_experts=2, k=1, seed=3)
    batches = _batches(4, seed=3)
    want, _ = train_serial_moe(CFG, batches, moe, lr=0.1)

    def body(comm):
        return gather_full_state(comm, train_3d(comm, CFG, batches, dp=2, pp=2, ep=2, microbatches=2, moe=moe,
                                                lr=0.1))
    assert max_state_diff(run(body, ranks=4)[0], want) <= TOL


# -- collective matmul: the same training, the sequence-parallel collectives overlapped ------------

def _sp_training(comm, batches, overlap):
    res = train_3d(comm, CFG, batches, dp=2, tp=2, sequence_parallel=True, collective_matmul=overlap, lr=0.5)
    return gather_full_state(comm, res), res.losses


def test_collective_matmul_through_parallelize_equals_it_without():
    """The overlapped layers do the plain layers' products in the same ring order, so the runs agree up
    to a length-k dot product's rounding in two orders (test_collective_matmul's bound, 2 k u of the
    scale, k the longest contraction on a path: here 4 d_model x T), over 2 steps."""
    batches = _batches(2, seed=5)
    (want, want_losses), (got, losses) = (run(_sp_training, ranks=4, batches=batches, overlap=o)[0]
                                          for o in (False, True))
    bound = 2 * (4 * CFG.d_model * 8) * np.finfo(np.float64).eps / 2
    assert max_state_diff(got, want) <= bound * max(1.0, max(float(np.abs(v).max()) for v in want.values()))
    np.testing.assert_allclose(losses, want_losses, rtol=0, atol=bound)


def _switched(comm, **kw):
    par = parallelize(CFG.replace(n_head=4), Mesh(comm, **kw.pop("sizes")), **kw)
    modes = {m.mode for _, m in par.model.named_modules() if type(m).__name__ == "ContextParallelAttention"}
    overlapped = sum(bool(getattr(m, "collective_matmul", False)) for _, m in par.model.named_modules())
    return modes, overlapped


@pytest.mark.parametrize("kw,want", [
    (dict(sizes=dict(cp=4), cp_mode="ulysses"), ({"ulysses"}, 0)),
    (dict(sizes=dict(cp=4), cp_mode="hybrid", ulysses_size=2), ({"hybrid"}, 0)),
    (dict(sizes=dict(tp=2), sequence_parallel=True, collective_matmul=True), (set(), 2 * 4 + 1)),
])
def test_cp_mode_and_collective_matmul_reach_the_layers(kw, want):
    """What parallelize was asked for is what the model runs: every attention in the mode, every
    sequence-parallel Linear (qkv, proj, fc, mlp proj per block, the LM head) overlapped."""
    ranks = int(np.prod(list(kw["sizes"].values())))
    assert run(_switched, ranks=ranks, **kw) == [want] * ranks


def test_fp8_over_data_and_pipeline_parallelism_equals_the_serial_fp8_twin():
    """train_3d(fp8=) on dp = 2 x pp = 2 (2 microbatches): block scaling's tiles are row-local, so the
    parallel run quantizes what the serial FP8 GPT does; fp32, only the summation order differs."""
    from minidist.parallel.memory.fp8 import fp8_linear

    recipe, cfg, batches = Fp8Recipe("block", block=4), CFG.replace(dtype="float32"), _batches(4, seed=6)
    model = fp8_linear(GPT(cfg), recipe)
    opt = make_optimizer("sgd", model.parameters(), 0.5)
    for x, y in batches:
        model.loss(x, y).backward()
        opt.step()
        opt.zero_grad()
    want = {n: np.asarray(p.data, np.float64) for n, p in model.named_parameters()}

    def body(comm):
        return gather_full_state(comm, train_3d(comm, cfg, batches, dp=2, pp=2, microbatches=2, lr=0.5,
                                                fp8=recipe))
    assert max_state_diff(run(body, ranks=4)[0], want) <= 1e-6
