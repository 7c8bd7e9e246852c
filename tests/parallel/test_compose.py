"""The composition matrix: every pair of techniques trains to its serial twin's parameters, or is
refused with an error naming both -- never a wrong result.

Every supported pair is built through ``parallelize`` (``_train``) on the threads transport: a mesh
with dp = 2 when a data-parallel technique is in it, tp = 2 for TP / sequence parallel, pp = 2 (2
microbatches) for the pipeline; a tiny GPT (2 blocks, d_model 16, sequence 8, 4 rows); 2 steps;
then the full parameters are gathered and compared with ``_serial`` (one GPT, the whole batch, the
same optimizer). Plain SGD (lr 0.5) except with host offload (Adam, offloaded vs in-memory), so a
gradient-scale bug moves the parameters. Each refused pair ``parallelize`` can express raises there,
naming both, before anything is built: ``parallelize``'s table is the one place refusals live (the
techniques' constructors check no pairs, and there is one order, ``ORDER``, so no wrong one).

Tolerances: float64 where every technique is exact (1e-10: only the summation order differs).
bf16 / fp16 cells compare the fp32 master weights with a serial twin in the same precision; the
parallel run rounds partial results (per-rank gradients, row-parallel partial products, per
microbatch) where the twin rounds once, so they agree to ``LOW_TOL`` (bf16 keeps 8 bits:
2^-8 ~ 4e-3 relative on a gradient of O(0.1), times lr 0.5, over 2 steps; fp16 keeps 11 bits).
"""

import re
import types
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest

from minidist.autograd import ops
from minidist.autograd import random as mrandom
from minidist.comm import Mesh, run
from minidist.nn import GPT, GPTConfig
from minidist.nn.optim import SGD, AdamW
from minidist.parallel.data.compress import make_hook
from minidist.parallel.data.zero import ZeRO
from minidist.parallel.experts.model import moe_gpt
from minidist.parallel.memory.fp8 import Fp8Recipe, fp8_linear
from minidist.parallel.memory.precision import DynamicLossScaler, MixedPrecision
from minidist.parallel.memory.recompute import apply_checkpointing
from minidist.parallel.options import Options, check_values
from minidist.parallel.parallelize import NAMES, ORDER, REFUSED, TECHNIQUES, matrix_markdown, parallelize
from minidist.parallel.three_d import gather_full_state

ROOT = Path(__file__).resolve().parents[2]
CFG = GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, d_model=16, dtype="float64")
DATA = np.random.default_rng(0).integers(0, 16, (2, 4, 8))  # 2 steps of 4 rows x 8 tokens
LR_SGD, LR_ADAM = 0.5, 1e-2
LOSS_SCALE = 2.0 ** 8
EXACT_TOL = 1e-10
LOW_TOL = {"bf16": 5e-3, "fp16": 5e-4}  # measured: 1.1e-3 and 1.7e-4 at most
FP8 = Fp8Recipe("block", block=4)  # 4 divides every Linear's tp = 2 shard (8, 24, 32 columns / rows)
FP8_TOL = 1e-6  # fp32 only the summation order differs (measured 3e-8 at most); the tiles are row-local
DP = {"ddp", "zero1", "zero2", "zero3", "live"}  # live recovery: DDP over a quorum (every replica, here)
PRECISIONS = ("bf16", "fp16")
MOE = dict(n_experts=2, k=1)

PAIRS = list(combinations(ORDER, 2))  # every unordered pair of techniques, in parallelize's order
SUPPORTED_PAIRS = [p for p in PAIRS if frozenset(p) not in REFUSED]
REFUSED_PAIRS = [p for p in PAIRS if frozenset(p) in REFUSED]


def _precision(pair):
    return next((t for t in pair if t in PRECISIONS), None)


def _cfg(pair):
    """float64 unless mixed precision (fp32 masters); dropout 0.1 where the parallel run draws the
    serial twin's masks (TP's "twin" dropout RNG): so a recomputation must replay the RNG. Data,
    pipeline, context and expert parallelism split the batch or the tokens, so their ranks draw
    other masks: no dropout there."""
    cfg = CFG if _precision(pair) is None and "fp8" not in pair else CFG.replace(dtype="float32")
    return cfg if set(pair) & (DP | {"pp", "cp", "ep"}) else cfg.replace(dropout=0.1)


def _mesh_sizes(pair):
    """dp = 2 for a data-parallel technique or experts (ep = 2 of them), tp = 2, pp = 2, cp = 2."""
    t = set(pair)
    dp = 2 if t & (DP | {"ep"}) else 1
    return dict(dp=dp, tp=2 if t & {"tp", "sp"} else 1, pp=2 if "pp" in t else 1, cp=2 if "cp" in t else 1,
                ep=2 if "ep" in t else 1)


def _ranks(pair):
    return int(np.prod([v for k, v in _mesh_sizes(pair).items() if k != "ep"]))


def _options(pair) -> dict:
    """``parallelize``'s keyword arguments for the techniques of ``pair``."""
    t, opts = set(pair), {}
    zero = [int(z[-1]) for z in t if z.startswith("zero")]
    if zero:
        opts["zero"] = zero[0] if len(zero) == 1 else zero
    rec = [c for c in ("recompute-full", "recompute-selective") if c in t]
    if rec:
        opts["recompute"] = rec[0].split("-")[1] if len(rec) == 1 else rec
    if _precision(pair):
        opts["precision"] = _precision(pair)
    if "ep" in t:
        opts["moe"] = MOE
    if "fp8" in t:
        opts["fp8"] = FP8
    if "live" in t:
        opts["live"] = True
    return dict(opts, sequence_parallel="sp" in t, offload="offload" in t,
                optimizer="adamw" if "offload" in t else "sgd", lr=LR_ADAM if "offload" in t else LR_SGD,
                microbatches=2 if "pp" in t else 1, loss_scale=LOSS_SCALE)


def _serial(pair, data=None):
    """The serial twin: one GPT on the whole batch, in the pair's precision, the same optimizer."""
    precision = _precision(pair)
    mrandom.manual_seed(0)
    model = GPT(_cfg(pair))
    if "ep" in pair:
        moe_gpt(model, **MOE)
    if "fp8" in pair:
        fp8_linear(model, FP8)
    scaler = DynamicLossScaler(init_scale=LOSS_SCALE) if precision == "fp16" else None
    mp = MixedPrecision(model, precision, scaler=scaler) if precision else None
    params = mp.master_params if mp else model.parameters()
    opt = AdamW(params, lr=LR_ADAM, weight_decay=0.0) if "offload" in pair else SGD(params, lr=LR_SGD)
    for x in DATA if data is None else data:
        if mp:
            mp.backward(mp.loss(x, x))
            assert mp.step(opt)
        else:
            model.loss(x, x).backward()
            opt.step()
            opt.zero_grad()
    names = [n for n, _ in model.named_parameters()]
    return {n: np.asarray(p.data, np.float64) for n, p in zip(names, params)}


def _train(comm, pair, data=None, **extra):
    """``parallelize`` the pair's techniques (and ``extra`` options), train 2 steps on ``data`` (default
    ``DATA``), return the full parameters (rank 0)."""
    mesh = Mesh(comm, **_mesh_sizes(pair))
    mrandom.manual_seed(0)
    par = parallelize(_cfg(pair), mesh, **dict(_options(pair), **extra))
    try:
        for x in DATA if data is None else data:
            par.step(x, x)
            if par.mp is not None:
                assert not par.mp.last_found_inf, "a mixed-precision step was skipped"
    finally:
        par.close()
    state = gather_full_state(comm, types.SimpleNamespace(mesh=mesh, parallel=par))
    return None if state is None else {n: np.asarray(v, np.float64) for n, v in state.items()}


def _max_diff(a, b):
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())[:5]
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


@pytest.mark.parametrize("pair", SUPPORTED_PAIRS, ids=lambda p: "+".join(p))
def test_supported_pair_through_parallelize_equals_serial_twin(pair):
    want = _serial(pair)
    precision = _precision(pair)
    tol = LOW_TOL[precision] if precision else FP8_TOL if "fp8" in pair else EXACT_TOL
    got = run(_train, ranks=_ranks(pair), pair=pair)[0]
    assert _max_diff(got, want) < tol, f"{' with '.join(pair)} (parallelize) differs from the serial twin"


DUAL_DATA = np.random.default_rng(1).integers(0, 16, (2, 8, 8))  # 2 steps of 8 rows: dp 2 x 4 microbatches
WITH_PP = [t for t in ORDER if t != "pp" and frozenset((t, "pp")) not in REFUSED]


@pytest.mark.parametrize("technique", WITH_PP)
def test_dualpipe_with_each_technique_a_pipeline_takes_equals_serial_twin(technique):
    """Full DualPipe (pp = 2, 4 microbatches: two copies of the model, their gradients summed by the
    runtime after DDP's) in every composition a pipeline has."""
    pair = (technique, "pp")
    want = _serial(pair, DUAL_DATA)
    precision = _precision(pair)
    tol = LOW_TOL[precision] if precision else FP8_TOL if "fp8" in pair else EXACT_TOL
    got = run(_train, ranks=_ranks(pair), pair=pair, data=DUAL_DATA, schedule="dualpipe", microbatches=4)[0]
    assert _max_diff(got, want) < tol, f"{technique} with dualpipe differs from the serial twin"


def test_dualpipe_refuses_delayed_fp8_scaling():
    """Each copy would keep its own amax history, from half of the microbatches."""
    cfg = CFG.replace(dtype="float32")
    with pytest.raises(ValueError, match="fp8 delayed scaling with schedule='dualpipe'"):
        check_values(Options(pp=2, schedule="dualpipe", fp8=Fp8Recipe("delayed")), cfg)
    check_values(Options(pp=2, schedule="dualpipe", fp8=Fp8Recipe("current")), cfg)
    check_values(Options(pp=2, schedule="1f1b", fp8=Fp8Recipe("delayed")), cfg)


def _parallelize_refusal(comm, pair):
    mesh = Mesh(comm, **_mesh_sizes(pair))
    try:
        parallelize(CFG, mesh, **_options(pair))
    except ValueError as e:
        return str(e)
    return None


#: refused pairs that are one choice of one option (one ZeRO stage, one policy, one dtype, ZeRO or
#: DDP): parallelize cannot be asked for both; the table says why, an option's value check refuses
ONE_CHOICE = {frozenset(p) for p in REFUSED_PAIRS if set(p) <= DP - {"live"} or set(p) <= set(PRECISIONS)
              or set(p) == {"recompute-full", "recompute-selective"}}


@pytest.mark.parametrize("pair", [p for p in REFUSED_PAIRS if frozenset(p) not in ONE_CHOICE], ids="+".join)
def test_refused_pair_raises_at_parallelize_naming_both(pair):
    a, b = pair
    for rank, msg in enumerate(run(_parallelize_refusal, ranks=_ranks(pair), pair=pair)):
        assert msg is not None, f"rank {rank}: parallelize accepted {a} with {b}"
        assert TECHNIQUES[a] in msg and TECHNIQUES[b] in msg, msg
        assert REFUSED[frozenset(pair)] in msg, msg


def _mode_refusal(comm, sizes, **kw):
    try:
        parallelize(CFG.replace(dtype="float32"), Mesh(comm, **sizes), **kw)
    except ValueError as e:
        return str(e)


@pytest.mark.parametrize("mode,technique,sizes,kw", [
    ("overlap", "fp8", dict(tp=2), dict(sequence_parallel=True, collective_matmul=True, fp8=FP8)),
    ("hook", "zero1", dict(dp=2), dict(zero=1, comm_hook=make_hook("dense"))),
    ("hook", "live", dict(dp=2), dict(live=True, comm_hook=make_hook("dense"))),
])
def test_a_mode_refused_with_a_technique_names_both(mode, technique, sizes, kw):
    """The table's rows for an option that changes how a technique runs (collective matmul: how
    sequence parallelism communicates; a comm hook: DDP's) are checked as the pairs are."""
    for msg in run(_mode_refusal, ranks=2, sizes=sizes, **kw):
        assert NAMES[mode] in msg and NAMES[technique] in msg, msg
        assert REFUSED[frozenset((mode, technique))] in msg, msg


def test_the_one_choice_pairs_are_what_parallelize_cannot_express():
    assert ONE_CHOICE == {frozenset(p) for p in
                          [("ddp", "zero1"), ("ddp", "zero2"), ("ddp", "zero3"), ("zero1", "zero2"),
                           ("zero1", "zero3"), ("zero2", "zero3"), ("bf16", "fp16"),
                           ("recompute-full", "recompute-selective")]}
    with pytest.raises(ValueError, match=r"zero=\[1, 2\]; use None \(DDP\) or a ZeRO stage 1, 2 or 3"):
        run(lambda comm: parallelize(CFG, Mesh(comm, dp=2), zero=[1, 2]), ranks=2)


# -- the table is the one the README shows ---------------------------------------------------------

def test_readme_matrix_is_generated_from_the_table():
    text = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- composition matrix: begin.*?-->\n(.*?)\n<!-- composition matrix: end -->",
                  text, re.S)
    assert m, "README has no generated composition matrix section"
    assert m.group(1).strip() == matrix_markdown().strip(), \
        "README is stale: paste `python -m minidist.parallel.parallelize --matrix` between the markers"


def test_every_pair_has_one_verdict_and_refusals_say_why():
    n = len(TECHNIQUES)
    assert len(PAIRS) == n * (n - 1) // 2 == len(SUPPORTED_PAIRS) + len(REFUSED_PAIRS)
    grid = [line for line in matrix_markdown().splitlines() if line.startswith("| **")]
    assert len(grid) == n and all(line.count("|") == n + 2 for line in grid)
    assert all(REFUSED.values()) and all(len(pair) == 2 and pair <= set(NAMES) for pair in REFUSED)
    assert sum("✗" in cell for line in grid for cell in line.split("|")) == 2 * len(REFUSED_PAIRS)


def test_no_technique_consults_the_composition_layer():
    """The table is parallelize's alone: no technique imports it (or the mesh trainer built on it)."""
    offenders = []
    for path in (ROOT / "minidist" / "parallel").rglob("*.py"):
        if path.parent.name == "parallel":
            continue  # parallelize.py, options.py, three_d.py ...: the composition layer itself
        text = path.read_text()
        for layer in ("parallelize", "parallelized", "options", "three_d", "compose"):
            if re.search(rf"minidist\.parallel(\.{layer}\b| import {layer}\b)", text):
                offenders.append(f"{path.relative_to(ROOT)}: {layer}")
    assert not offenders, offenders


def test_nothing_outside_module_py_assigns_forward():
    offenders = []
    for path in (ROOT / "minidist").rglob("*.py"):
        if path.name == "module.py" and path.parent.name == "nn":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"""__setattr__\([^)]*["']forward["']|\.forward\s*=[^=]""", line):
                offenders.append(f"{path.relative_to(ROOT)}:{i}")
    assert not offenders, offenders


# -- the wrapper stack itself: every technique at its position, each removable ---------------------

def _offloaded_run(comm, offload_first):
    from minidist.parallel.memory.offload import offload_activations

    model = apply_checkpointing(GPT(CFG), "full")
    if offload_first:
        handles = [offload_activations(m) for m in model.children()]
    zero = ZeRO(model, comm, lambda ps: SGD(ps, lr=LR_SGD), stage=3)
    if not offload_first:
        handles = [offload_activations(m) for m in model.children()]
    for x in DATA:
        x = x[2 * comm.rank:2 * comm.rank + 2]
        zero.backward(model.loss(x, x))
        zero.step()
    positions = [h.position for h in model[1].forward_wrappers()]
    for h in handles:
        h.remove()
    return zero.full_parameters(), positions, [h.position for h in model[1].forward_wrappers()]


@pytest.mark.parametrize("offload_first", [True, False])
def test_activation_offload_zero3_and_checkpointing_stack_in_order_and_equal_serial(offload_first):
    want = _serial(("recompute-full", "zero3"))
    for got, positions, after in run(_offloaded_run, ranks=2, offload_first=offload_first):
        assert _max_diff({k: np.asarray(v) for k, v in got.items()}, want) < EXACT_TOL
        assert positions == ["recompute", "offload", "zero3"]  # the documented order, whatever came first
        assert after == ["recompute", "zero3"]  # removing one leaves the others


def test_activation_offload_moves_saved_activations_off_the_device():
    from minidist.nn.footprint import MemoryAccountant
    from minidist.parallel.memory.offload import offload_activations

    x = DATA[0]
    peaks, grads = [], []
    for offload in (False, True):
        model = GPT(CFG)
        if offload:
            for blk in list(model)[1:-1]:
                offload_activations(blk)
        meter = MemoryAccountant()
        with meter.track_activations(model):
            out = model(x)
        ops.cross_entropy(out, x).backward()
        peaks.append(meter.peak_activation_bytes)
        grads.append({n: p.grad for n, p in model.named_parameters()})
    blocks = CFG.n_layer * 4 * 8 * CFG.d_model * 8  # at least the blocks' (B, T, C) inputs, float64
    assert peaks[1] <= peaks[0] - blocks
    for n in grads[0]:
        np.testing.assert_array_equal(grads[0][n], grads[1][n])


def test_a_second_wrapper_at_a_taken_position_is_refused_naming_both():
    model = apply_checkpointing(GPT(CFG), "full")
    with pytest.raises(ValueError, match=r"already has a 'recompute' forward wrapper \(from activation "
                                         r"recomputation \(full\)\); tracing cannot"):
        model[1].register_forward_wrapper(lambda m, inner, x: inner(x), "recompute", "tracing")
    with pytest.raises(AttributeError, match="register_forward_wrapper"):
        model[1].forward = lambda x: x


def test_tracing_registers_through_the_stack_and_comes_off():
    from minidist import trace

    model = apply_checkpointing(GPT(CFG), "full")
    handles = trace.trace_layers(model)
    tracer = trace.Tracer(0)
    with trace.tracing(tracer):
        model.loss(DATA[0], DATA[0]).backward()
    assert [e["name"] for e in tracer.events] == ["forward 0 (Embed)", "forward 1 (Block)",
                                                  "forward 2 (Block)", "forward 3 (Head)"]
    assert [h.position for h in model[1].forward_wrappers()] == ["trace", "recompute"]
    for h in handles:
        h.remove()
    with trace.tracing(tracer):
        model(DATA[0])
    assert len(tracer.events) == 4 and model[1].forward_wrappers()[0].position == "recompute"


def _gathers(comm, policy):
    model = apply_checkpointing(GPT(CFG), policy)
    zero = ZeRO(model, comm, lambda ps: SGD(ps, lr=LR_SGD), stage=3)
    x = DATA[0][2 * comm.rank:2 * comm.rank + 2]
    zero.backward(model.loss(x, x))
    zero.step()
    return len(zero.gather_log)


def test_zero3_under_checkpointing_gathers_no_more_than_without():
    """A recomputation gathers a unit; the backward right after it uses that gather instead of
    releasing and gathering again, so checkpointing adds no all-gather: forward, then one per unit
    whose backward needs weights (every unit but the embedding), as without checkpointing."""
    plain = run(_gathers, ranks=2, policy="none")
    assert plain == [4 + 3] * 2  # Embed, 2 Blocks, Head in forward; the Blocks and Head again
    for policy in ("full", "selective"):
        assert run(_gathers, ranks=2, policy=policy) == plain


def _zero3_segments(comm, checkpoint_first):
    model = GPT(CFG)
    if checkpoint_first:
        apply_checkpointing(model, "every_k", k=2)  # one segment of both blocks: two ZeRO-3 units
    zero = ZeRO(model, comm, lambda ps: SGD(ps, lr=LR_SGD), stage=3)
    if not checkpoint_first:
        apply_checkpointing(model, "every_k", k=2)
    for x in DATA:
        x = x[2 * comm.rank:2 * comm.rank + 2]
        zero.backward(model.loss(x, x))
        zero.step()
    return {k: np.asarray(v) for k, v in zero.full_parameters().items()}


@pytest.mark.parametrize("checkpoint_first", [True, False])
def test_a_checkpoint_segment_spanning_zero3_units_equals_serial(checkpoint_first):
    """The issue's bug, in its hardest form: the segment's recomputation runs both blocks' inner
    stacks, so each re-gathers its own (released) unit."""
    want = _serial(("recompute-full", "zero3"))
    for got in run(_zero3_segments, ranks=2, checkpoint_first=checkpoint_first):
        assert _max_diff(got, want) < EXACT_TOL
