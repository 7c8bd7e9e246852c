"""The composition matrix: every pair of techniques trains to its serial twin's parameters, or is
refused at construction with an error naming both -- never a wrong result.

One harness (``_train``) builds any pair in a given order on the threads transport: a mesh with
dp = 2 when a data-parallel technique is in it, tp = 2 for TP / sequence parallel, pp = 2 for the
pipeline; a tiny GPT (2 blocks, d_model 16, sequence 8, 4 rows); 2 steps; then the full
parameters are gathered and compared with ``_serial`` (one GPT, the whole batch, the same
optimizer). Plain SGD (lr 0.5) except with host offload (Adam, offloaded vs in-memory), so a
gradient-scale bug moves the parameters.

Tolerances: float64 where every technique is exact (1e-10: only the summation order differs).
bf16 / fp16 cells compare the fp32 master weights with a serial twin in the same precision; the
parallel run rounds partial results (per-rank gradients, row-parallel partial products, per
microbatch) where the twin rounds once, so they agree to ``LOW_TOL`` (bf16 keeps 8 bits:
2^-8 ~ 4e-3 relative on a gradient of O(0.1), times lr 0.5, over 2 steps; fp16 keeps 11 bits).
"""

import re
from pathlib import Path

import numpy as np
import pytest

from minidist.autograd import ops
from minidist.autograd import random as mrandom
from minidist.comm import Mesh, run
from minidist.nn import GPT, GPTConfig
from minidist.nn.optim import SGD, AdamW
from minidist.parallel import compose
from minidist.parallel.data.ddp import DDP
from minidist.parallel.data.zero import ZeRO
from minidist.parallel.memory.offload import OffloadedAdamW
from minidist.parallel.memory.precision import DynamicLossScaler, MixedPrecision
from minidist.parallel.memory.recompute import apply_checkpointing
from minidist.parallel.pipeline.runtime import (
    PipelineStage,
    make_schedule,
    partition_uniform,
    run_schedule,
    split_microbatches,
)
from minidist.parallel.tensor.sharding import sharding_table, unshard

ROOT = Path(__file__).resolve().parents[2]
CFG = GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, d_model=16, dtype="float64")
DATA = np.random.default_rng(0).integers(0, 16, (2, 4, 8))  # 2 steps of 4 rows x 8 tokens
LR_SGD, LR_ADAM = 0.5, 1e-2
EXACT_TOL = 1e-10
LOW_TOL = {"bf16": 5e-3, "fp16": 5e-4}  # measured: 1.1e-3 and 1.7e-4 at most
DP = {"ddp", "zero1", "zero2", "zero3"}
PRECISIONS = ("bf16", "fp16")


def _orders(a, b):
    """The orders the API allows for a supported pair (the table's ``first``, else both)."""
    r = compose.rule(a, b)
    if r.first is not None:
        return [(r.first, b if r.first == a else a)]
    return [(a, b), (b, a)]


SUPPORTED = [order for a, b in compose.pairs() if compose.rule(a, b).supported for order in _orders(a, b)]
SUPPORTED_PAIRS = [(a, b) for a, b in compose.pairs() if compose.rule(a, b).supported]
REFUSED = [(a, b) for a, b in compose.pairs() if not compose.rule(a, b).supported]


def _precision(order):
    return next((t for t in order if t in PRECISIONS), None)


def _scaler(precision):
    return DynamicLossScaler(init_scale=2.0 ** 8) if precision == "fp16" else None


def _optimizer(order, params):
    if "offload" in order:
        return OffloadedAdamW(params, None, lr=LR_ADAM, weight_decay=0.0, where="host", prefetch=False)
    return SGD(params, lr=LR_SGD)


def _cfg(order):
    """float64 unless mixed precision (fp32 masters); dropout 0.1 where the parallel run draws the
    serial twin's masks (TP's "twin" dropout RNG): so a recomputation must replay the RNG. Data and
    pipeline parallelism split the batch, so their ranks draw other masks: no dropout there."""
    cfg = CFG if _precision(order) is None else CFG.replace(dtype="float32")
    return cfg if set(order) & (DP | {"pp"}) else cfg.replace(dropout=0.1)


def _serial(order):
    """The serial twin: one GPT on the whole batch, in the pair's precision, the same optimizer."""
    precision = _precision(order)
    mrandom.manual_seed(0)
    model = GPT(_cfg(order))
    mp = MixedPrecision(model, precision, scaler=_scaler(precision)) if precision else None
    params = mp.master_params if mp else model.parameters()
    opt = AdamW(params, lr=LR_ADAM, weight_decay=0.0) if "offload" in order else SGD(params, lr=LR_SGD)
    for x in DATA:
        if mp:
            mp.backward(mp.loss(x, x))
            assert mp.step(opt)
        else:
            model.loss(x, x).backward()
            opt.step()
            opt.zero_grad()
    names = [n for n, _ in model.named_parameters()]
    return {n: np.asarray(p.data, np.float64) for n, p in zip(names, params)}


def _stage_loss(base_loss, mp):
    """The last stage's loss: with mixed precision, of fp32 logits and times the loss scale (what
    ``mp.loss`` and ``mp.backward`` do outside a pipeline)."""
    if mp is None:
        return base_loss
    return lambda logits, y: base_loss(ops.cast(logits, np.float32), y) * mp.scale


def _train(comm, order):
    """Apply the techniques of ``order`` in that order, train 2 steps, return the full parameters."""
    t = set(order)
    dp, tp, pp = 2 if t & DP else 1, 2 if t & {"tp", "sp"} else 1, 2 if "pp" in t else 1
    mesh = Mesh(comm, dp=dp, pp=pp, tp=tp)
    mrandom.manual_seed(0)
    cfg = _cfg(order)
    if tp > 1:
        from minidist.parallel.tensor.gpt import TPGPT

        model = TPGPT(cfg, mesh.tp, sequence_parallel="sp" in t)
        base_loss = model.loss_fn
    else:
        model, base_loss = GPT(cfg), ops.cross_entropy
    table = sharding_table(model)
    mp = ddp = zero = stage = None
    for name in order:
        if name in ("ckpt-full", "ckpt-selective"):
            apply_checkpointing(model, "full" if name == "ckpt-full" else "selective")
        elif name in PRECISIONS:
            mp = MixedPrecision(model, name, scaler=_scaler(name), groups=[mesh.pp] if pp > 1 else None)
        elif name == "pp":
            bounds = partition_uniform(len(model), pp)
            stage = PipelineStage(model, bounds, mesh.pp_rank, pp, loss_fn=_stage_loss(base_loss, mp))
        elif name == "ddp":
            ddp = DDP(stage if stage is not None else model, mesh.dp)
        elif name in DP:
            zero = ZeRO(model, mesh.dp, lambda ps: _optimizer(order, ps), stage=int(name[-1]))
    owner = stage if stage is not None else model
    opt = None if zero else _optimizer(order, mp.master_params if mp else owner.parameters())

    def step():
        if ddp is not None:
            ddp.wait_gradients()
        if mp is not None:
            assert mp.step(opt), "a mixed-precision step was skipped"
        else:
            opt.step()
            opt.zero_grad()

    rows = DATA.shape[1] // dp
    for x in DATA:
        x = x[mesh.dp_rank * rows:(mesh.dp_rank + 1) * rows]
        if stage is not None:
            xs, ys = split_microbatches(x, 2, comm.rank), split_microbatches(x, 2, comm.rank)
            run_schedule(stage, mesh.pp, make_schedule("1f1b", pp, 2)[mesh.pp_rank], xs, ys, step, ddp=ddp)
            continue
        loss = mp.loss(x, x) if mp else base_loss(model(x), x)
        if zero is not None:
            zero.backward(loss)
            zero.step()
        elif mp is not None:
            mp.backward(loss)
            step()
        else:
            (ddp.backward if ddp else type(loss).backward)(loss)
            step()
    if zero is not None:
        state = zero.full_parameters()
    elif mp is not None:
        state = {m.name: m.data for m in mp.master_params}
    else:
        state = dict(model.named_parameters())
        state = {n: p.data for n, p in state.items()}
    if stage is not None:
        mine = {n for n, _ in stage.named_parameters()}
        state = {n: v for n, v in state.items() if n in mine}
    state = {n: np.asarray(v, np.float64) for n, v in state.items()}
    if tp > 1:
        state = unshard(mesh.tp.allgather_obj(state), table)
    if pp > 1:
        merged = {}
        for part in mesh.pp.allgather_obj(state):
            merged.update(part)
        state = merged
    for o in (opt, getattr(zero, "optimizer", None)):
        if hasattr(o, "close"):
            o.close()
    return state


def _max_diff(a, b):
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())[:5]
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


@pytest.mark.parametrize("order", SUPPORTED, ids=lambda o: "+".join(o))
def test_supported_pair_equals_serial_twin(order):
    t = set(order)
    ranks = (2 if t & DP else 1) * (2 if t & {"tp", "sp"} else 1) * (2 if "pp" in t else 1)
    want = _serial(order)
    precision = _precision(order)
    tol = EXACT_TOL if precision is None else LOW_TOL[precision]
    for rank, got in enumerate(run(_train, ranks=ranks, order=order)):
        assert _max_diff(got, want) < tol, f"rank {rank}: {' then '.join(order)} differs from the serial twin"


# -- refusals: at construction, naming both ------------------------------------------------------

def _apply(comm, name, model, state):
    """Apply technique ``name`` to ``model`` on one rank (the refusal comes before any collective)."""
    if name in ("ckpt-full", "ckpt-selective"):
        apply_checkpointing(model, "full" if name == "ckpt-full" else "selective")
    elif name in PRECISIONS:
        MixedPrecision(model, name)
    elif name == "pp":
        state["stage"] = PipelineStage(model, partition_uniform(len(model), 1), 0, 1)
    elif name == "ddp":
        DDP(state.get("stage", model), comm)
    elif name in DP:
        ZeRO(state.get("stage", model), comm, lambda ps: SGD(ps, lr=0.1), stage=int(name[-1]))


def _refused(comm, first, second):
    model, state = GPT(CFG), {}
    _apply(comm, first, model, state)
    try:
        _apply(comm, second, model, state)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("pair", REFUSED, ids=lambda p: "+".join(p))
def test_refused_pair_raises_at_construction_naming_both(pair):
    a, b = pair
    reason = compose.rule(a, b).reason
    for first, second in ((a, b), (b, a)):
        msg = run(_refused, ranks=1, first=first, second=second)[0]
        assert msg is not None, f"{first} then {second} was accepted"
        assert compose.TECHNIQUES[a] in msg and compose.TECHNIQUES[b] in msg and reason in msg, msg


@pytest.mark.parametrize("first,second", [("ddp", "pp"), ("bf16", "ddp"), ("fp16", "ddp")])
def test_the_wrong_order_is_refused(first, second):
    msg = run(_refused, ranks=1, first=first, second=second)[0]
    assert msg is not None and "must be applied before" in msg
    assert compose.TECHNIQUES[first] in msg and compose.TECHNIQUES[second] in msg


# -- the table is the one the README shows ---------------------------------------------------------

def test_readme_matrix_is_generated_from_the_table():
    text = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- composition matrix: begin.*?-->\n(.*?)\n<!-- composition matrix: end -->",
                  text, re.S)
    assert m, "README has no generated composition matrix section"
    assert m.group(1).strip() == compose.matrix_markdown().strip(), \
        "README's matrix is stale: paste `python -m minidist.parallel.compose` between the markers"


def test_every_pair_has_one_verdict_and_refusals_say_why():
    n = len(compose.TECHNIQUES)
    assert len(compose.pairs()) == n * (n - 1) // 2 == len(SUPPORTED_PAIRS) + len(REFUSED)
    grid = [line for line in compose.matrix_markdown().splitlines() if line.startswith("| **")]
    assert len(grid) == n and all(line.count("|") == n + 2 for line in grid)
    assert all(compose.rule(a, b).reason for a, b in REFUSED)
    assert compose.rule("ddp", "zero3") == compose.rule("zero3", "ddp")  # symmetric


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
    want = _serial(("ckpt-full", "zero3"))
    for got, positions, after in run(_offloaded_run, ranks=2, offload_first=offload_first):
        assert _max_diff({k: np.asarray(v) for k, v in got.items()}, want) < EXACT_TOL
        assert positions == ["checkpoint", "offload", "zero3"]  # the documented order, whatever came first
        assert after == ["checkpoint", "zero3"]  # removing one leaves the others


def test_activation_offload_moves_saved_activations_off_the_device():
    from minidist.memory import MemoryAccountant
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
    with pytest.raises(ValueError, match=r"already has a 'checkpoint' forward wrapper \(from activation "
                                         r"checkpointing \(full\)\); tracing cannot"):
        model[1].register_forward_wrapper(lambda m, inner, x: inner(x), "checkpoint", "tracing")
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
    assert [h.position for h in model[1].forward_wrappers()] == ["trace", "checkpoint"]
    for h in handles:
        h.remove()
    with trace.tracing(tracer):
        model(DATA[0])
    assert len(tracer.events) == 4 and model[1].forward_wrappers()[0].position == "checkpoint"


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
    want = _serial(("ckpt-full", "zero3"))
    for got in run(_zero3_segments, ranks=2, checkpoint_first=checkpoint_first):
        assert _max_diff(got, want) < EXACT_TOL
