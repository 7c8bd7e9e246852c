"""``parallelize``: every technique applied to one GPT in one documented order, and the one table of refusals.

    opts = check(Options(dp=2, pp=2, tp=2, microbatches=4, recompute="full", precision="bf16"), cfg, 8)
    par = parallelize(cfg, Mesh(comm, **opts.mesh), opts)   # or parallelize(cfg, mesh, **flags)
    for x, y in batches:                                     # global batches, the same on every rank
        stats = par.step(x, y)

``ORDER`` (torchtitan's ``parallelize_llama`` has its shape), each step a few lines below: 1. model
transforms -- TP / sequence parallelism (``TPGPT``), experts, context parallelism, collective matmul,
FP8 Linears; 2. the pipeline cut (without ZeRO a ``PipelineStage``; DualPipe's holds a piece of each
of two model copies, whose gradients the runtime sums); 3. recomputation per stage chunk; 4. mixed
precision over the stage's layers; 5. data parallelism over the replicas (DDP on the stage, ZeRO on
the model, or live recovery over each step's quorum of replica groups); 6. the optimizer (host
offload: ``OffloadedAdamW``). Chapter 3 says why this order.

``REFUSED`` is the one table of refusals. ``check`` validates every flag once, before any rank starts:
the mesh and the values (``options.py``), each pair of chosen techniques against the table (a
``ValueError`` naming both and why), the pipeline schedule. Every pair not in the table combines,
in ``ORDER`` (``tests/parallel/test_compose.py`` trains each against its serial twin). README's
matrix is ``python -m minidist.parallel.parallelize --matrix``.
"""

from __future__ import annotations

import sys
from dataclasses import replace

from minidist.autograd import ops
from minidist.nn.module import Module, ModuleList
from minidist.parallel.context.model import context_parallel
from minidist.parallel.data.ddp import DistributedDataParallel
from minidist.parallel.data.live.quorum_ddp import QuorumDataParallel, StaticQuorum
from minidist.parallel.data.zero import ZeRO
from minidist.parallel.experts.model import expert_names, moe_gpt
from minidist.parallel.memory.fp8 import fp8_linear
from minidist.parallel.memory.precision import DynamicLossScaler, MixedPrecision
from minidist.parallel.memory.recompute import apply_recompute, check_segments_within, recompute_stage
from minidist.parallel.options import Options, check_3d, check_values
from minidist.parallel.parallelize_parts import build_model, optimizer_factory, scaled_loss
from minidist.parallel.parallelized import Parallelized, token_loss_weights
from minidist.parallel.pipeline.catalog import make_schedule, schedule_chunks
from minidist.parallel.pipeline.partition import partition_for, partition_uniform
from minidist.parallel.pipeline.stage import PipelineStage
from minidist.parallel.tensor.collective_matmul import use_collective_matmul

__all__ = ["ORDER", "Options", "Parallelized", "REFUSED", "TECHNIQUES", "build_model", "check", "check_3d",
           "matrix_markdown", "optimizer_factory", "parallelize", "scaled_loss", "techniques",
           "token_loss_weights"]

#: technique -> the name errors and the README use, in the order ``parallelize`` applies them
TECHNIQUES = {"tp": "TP", "sp": "sequence parallel", "ep": "experts (MoE)", "cp": "context parallel",
              "fp8": "FP8 training", "pp": "pipeline (PP)", "recompute-full": "recompute (full)",
              "recompute-selective": "recompute (selective)", "bf16": "bf16 mixed precision",
              "fp16": "fp16 mixed precision", "ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2",
              "zero3": "ZeRO-3", "live": "live recovery", "offload": "host offload"}
ORDER = tuple(TECHNIQUES)
#: options that change how a technique runs (sequence parallelism's, DDP's): in the table, not the grid
MODES = {"overlap": "collective matmul", "hook": "a DDP comm hook"}
ZERO, LOW = ("zero1", "zero2", "zero3"), ("bf16", "fp16")
RECOMPUTE = ("recompute-full", "recompute-selective")
_TABLE = [  # (these, those, why): a technique of these with one of those is refused
    (["ddp"], ZERO, "ZeRO is data parallelism itself: it averages (and shards) the gradients over the same "
                    "ranks DDP would; use one of them"),
    (ZERO, ZERO, "one ZeRO stage per model: each owns the gradient sync and the optimizer step"),
    (ZERO, LOW, "ZeRO shards and steps the model's own parameters with its optimizer, while MixedPrecision "
                "steps fp32 master copies with another; sharded fp32 masters are not built"),
    (ZERO, ["pp"], "a PipelineStage is not a Module (ZeRO-3 gathers a Module's layers as units) and "
                   "run_schedule drives only DDP through the microbatches; ZeRO over a pipeline's "
                   "data-parallel group is not built: use DDP"),
    (ZERO, ["ep"], "ZeRO averages (and shards) every gradient over the data-parallel group, but expert "
                   "parameters differ across an ep group; use DDP, which ignores them (they are averaged "
                   "over the ranks holding the same experts)"),
    (ZERO, ["fp8"], "ZeRO with FP8 Linears is not built (nor tested against the serial FP8 twin); use DDP"),
    (ZERO, ["hook"], "a comm hook runs on DDP's all-reduced buckets, and ZeRO reduce-scatters them: pass "
                     "comm_hook=None or use DDP"),
    (LOW, LOW, "one compute dtype per model: autocast casts the parameters to one of them"),
    (LOW, ["fp8"], "one compute format per Linear: autocast casts the weights to 2 bytes, FP8 rounds the "
                   "fp32 ones; use one of them"),
    (RECOMPUTE, RECOMPUTE, "one recompute policy per block: both wrap the same blocks; choose one"),
    (RECOMPUTE, ["fp8"], "a recomputed forward would record the delayed-scaling amaxes twice; use FP8 "
                         "without activation recomputation"),
    (["cp"], ["sp"], "both split the sequence over ranks, and a ring over sequence-parallel shards is not "
                     "built"),
    (["cp"], ["recompute-selective"], "recompute='selective' recomputes the serial attention core, but ring "
                                      "attention keeps no T x T matrix to save; use 'full' or none"),
    (["ep"], ["sp"], "under sequence parallelism each tp rank's MLP sees only its own tokens, and an MoE's "
                     "expert gradients are not summed over the tp group: not built; use TP without sequence "
                     "parallelism"),
    (["overlap"], ["fp8"], "the FP8 wrappers run the sequence-parallel collectives unfused; use one of them"),
    (["live"], [*ZERO, "ep"],
     "ZeRO's optimizer-state shards and an ep group's experts each live on one replica group: a lost group "
     "takes them with it and no survivor holds a copy to heal from; use DDP (live recovery heals whole "
     "replicas) and keep checkpoints"),
    (["live"], ["cp"], "context parallelism averages gradients over dp x cp ranks in one DDP; a quorum over "
                       "the replica groups with cp inside each group is not built"),
    (["live"], [*LOW, "fp8", "offload"],
     "a heal moves the TrainState (parameters, optimizer state, RNG, data position); MixedPrecision's fp32 "
     "masters and loss scaler, FP8's amax history and OffloadedAdamW's host buffers are not in it: not "
     "built"),
    (["live"], ["hook"], "a comm hook compresses DDP's all-reduce; live recovery averages with its own "
                         "ordered reduction over the step's quorum: use one of them"),
]
#: the one table of refusals: {technique, technique} -> why
REFUSED = {frozenset((a, b)): why for these, those, why in _TABLE for a in these for b in those if a != b}
NAMES = {**TECHNIQUES, **MODES}


def techniques(o: Options) -> list[str]:
    """The techniques (and modes) a run with ``o`` applies, in ``ORDER``."""
    on = {"tp": o.tp > 1, "sp": o.sequence_parallel, "ep": o.moe is not None, "cp": o.cp > 1,
          "fp8": o.fp8 is not None, "pp": o.pp > 1, o.precision: o.precision in LOW,
          "ddp": not o.zero and o.dp * o.cp > 1, f"zero{o.zero}": bool(o.zero), "offload": o.offload,
          "live": o.live is not None,
          "overlap": o.collective_matmul, "hook": o.comm_hook is not None}
    if o.recompute not in (None, "none"):
        on["recompute-selective" if o.recompute == "selective" else "recompute-full"] = True
    return [t for t in NAMES if on.get(t)]


def check(o: Options, cfg, world_size: int, batch_size: int | None = None, seq_len: int | None = None,
          built: bool = False, rank: int = 0) -> Options:
    """Every error of a run with ``o``, raised before anything is built (``batch_size`` / ``seq_len``:
    the global batch's, if known); returns ``o`` marked checked, with its pipeline schedule built."""
    check_3d(world_size, cfg, batch_size, o.dp, o.pp, o.tp, o.microbatches,
             schedule_chunks(o.schedule, o.chunks), rank, o.cp, seq_len, o.ep, o.moe)
    chosen = techniques(o)
    for i, a in enumerate(chosen):
        for b in chosen[i + 1:]:
            if frozenset((a, b)) in REFUSED:
                raise ValueError(f"rank {rank}: {NAMES[a]} cannot be combined with {NAMES[b]}: "
                                 f"{REFUSED[frozenset((a, b))]}")
    check_values(o, cfg, built, rank)
    schedule = None if o.zero else make_schedule(o.schedule, o.pp, o.microbatches, o.chunks)
    return replace(o, checked=True, built_schedule=schedule)


def parallelize(cfg_or_model, mesh, opts: Options | None = None, **flags) -> Parallelized:
    """Apply every technique of ``opts`` -- or of ``flags``, ``Options``' fields (``checkpoint=``: the
    old name of ``recompute=``), checked here -- to a GPT (a ``GPTConfig``, or a built serial ``GPT``
    when tp = 1) on ``mesh``, in ``ORDER``."""
    built = isinstance(cfg_or_model, Module)
    cfg = cfg_or_model.config if built else cfg_or_model
    sizes = dict(dp=mesh.dp_size, pp=mesh.pp_size, tp=mesh.tp_size, cp=mesh.cp_size, ep=mesh.ep_size)
    if opts is None:
        opts = Options.of(**sizes, **flags)
    elif flags:
        raise TypeError(f"parallelize takes Options or flags, not both (got {sorted(flags)})")
    o = opts if opts.checked else check(opts, cfg, mesh.world.size, built=built, rank=mesh.world.rank)
    if o.mesh != sizes:
        raise ValueError(f"rank {mesh.world.rank}: the mesh is {sizes}, the options are for {o.mesh}")
    make_opt = optimizer_factory(o.optimizer, o.lr, o.offload)
    # 1. model transforms: TP / SP (overlapped: collective matmul), experts, context parallelism, FP8
    model, loss_fn = (cfg_or_model, None) if built else build_model(cfg, mesh.tp, o.sequence_parallel)
    loss_fn = loss_fn or ops.cross_entropy
    if o.collective_matmul:
        use_collective_matmul(model)
    if o.moe is not None:
        moe_gpt(model, ep=mesh.ep if mesh.ep_size > 1 else None, **o.moe)
    if o.cp > 1:
        context_parallel(model, mesh.cp, o.layout, mode=o.cp_mode, ulysses_size=o.ulysses_size)
    if o.fp8 is not None:
        fp8_linear(model, o.fp8)
    replicas = mesh.dp if o.cp == 1 else mesh.dp_cp  # the ranks whose gradients are averaged
    par = Parallelized(mesh, model, None, None, None, None, loss_fn, o.microbatches, layout=o.layout,
                       replicas=replicas, fp8=o.fp8 is not None)
    if o.zero:  # ZeRO shards a Module (its units): no pipeline cut, recomputation on the model
        if o.recompute is not None:
            apply_recompute(model, o.recompute)
        par.dp = ZeRO(model, replicas, make_opt, stage=o.zero, broadcast_from=None)
        par.optimizer = par.dp.optimizer
        return par
    # 2. the pipeline cut and 3. activation recomputation (per chunk)
    sched = o.built_schedule  # its placement: which pieces a rank holds
    par.bounds = (partition_uniform(len(model), sched.placement.num_virtual) if o.layer_costs is None
                  else partition_for(o.layer_costs, sched.placement))  # balances ranks, not pieces
    stage = par.stage = PipelineStage(model, par.bounds, mesh.pp_rank, o.pp, loss_fn=loss_fn,
                                      placement=sched.placement)
    for ids, chunk in zip(stage.layer_ids, stage.chunks):  # each chunk recomputes its own segments
        check_segments_within(chunk, ids, mesh.pp_rank)
        if o.recompute is not None:
            recompute_stage(chunk, o.recompute)
    par.instructions = sched[mesh.pp_rank]
    # 4. mixed precision over this stage's layers: its masters only, every rank agrees on a skip
    params = stage.parameters()
    if o.precision in LOW:
        layers = ModuleList([layer for _, layer in par.layers()])
        scaler = "auto" if o.loss_scale is None or o.precision != "fp16" else DynamicLossScaler(o.loss_scale)
        par.mp = MixedPrecision(layers, o.precision, scaler, groups=[mesh.tp, replicas, mesh.pp],
                                loss_fn=loss_fn)
        stage.loss_fn = scaled_loss(loss_fn, par.mp)
        params = par.mp.master_params
    # 5. data parallelism over the replicas (live: over the step's quorum of replica groups); experts are
    # synced over their own group at the step
    names = expert_names(par.layers())
    par.experts = [p for k, p in stage.named_parameters() if k in names]
    if o.live is not None:
        par.dp = QuorumDataParallel(stage, StaticQuorum(replicas) if o.live is True else o.live)
    elif o.dp * o.cp > 1:
        par.dp = DistributedDataParallel(stage, replicas, broadcast_from=None, ignore=par.experts)
        if o.comm_hook is not None:
            par.dp.register_comm_hook(*o.comm_hook)
    # 6. the optimizer, over what the others leave
    par.optimizer = make_opt(params)
    return par


def matrix_markdown() -> str:
    """README's composition matrix, from ``REFUSED``: ✓ combines (in ``ORDER``), ✗ n refused (note n)."""
    notes: dict[str, int] = {}

    def note(pair) -> int:
        return notes.setdefault(REFUSED[frozenset(pair)], len(notes) + 1)
    short = {t: name.replace(" mixed precision", "") for t, name in TECHNIQUES.items()}
    lines = ["| | " + " | ".join(short.values()) + " |", "|---" * (len(ORDER) + 1) + "|"]
    for a in ORDER:
        cells = ["·" if a == b else f"✗ {note((a, b))}" if frozenset((a, b)) in REFUSED else "✓"
                 for b in ORDER]
        lines.append(f"| **{short[a]}** | " + " | ".join(cells) + " |")
    modes = []
    for m in MODES:  # one phrase per reason: "a DDP comm hook with ZeRO-1, ZeRO-2 (n)"
        by_note: dict = {}
        for t in ORDER:
            if frozenset((m, t)) in REFUSED:
                by_note.setdefault(note((m, t)), []).append(TECHNIQUES[t])
        modes += [f"{MODES[m]} with {', '.join(ts)} ({n})" for n, ts in by_note.items()]
    return "\n".join(lines + ["", "Also refused: " + "; ".join(modes) + ".", ""]
                     + [f"{n}. {why}" for why, n in notes.items()])


if __name__ == "__main__":
    if sys.argv[1:] != ["--matrix"]:
        sys.exit("usage: python -m minidist.parallel.parallelize --matrix   (README's composition matrix)")
    print(matrix_markdown())
