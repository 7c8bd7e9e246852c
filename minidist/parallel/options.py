"""The flags of a parallelized run (``Options``) and the errors of their values, before any rank starts.

``parallelize.check`` validates an ``Options`` once -- here the mesh and batch (``check_3d``) and each
flag's value (``check_values``); there each pair of techniques against the one refusal table, and
the pipeline schedule -- and marks it ``checked``, so ``parallelize`` and ``train_mesh`` take it as it
is. Each error says what was wrong and what would be right.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from minidist.parallel.context.model import MODES as CP_MODES
from minidist.parallel.memory.fp8 import Fp8Recipe
from minidist.parallel.memory.recompute import POLICIES


@dataclass(frozen=True)
class Options:
    """Every flag of ``parallelize``: the mesh sizes, then the techniques in its order. ``recompute``:
    an activation-recomputation policy ("full", "sqrt", "every_k", "selective") per stage chunk;
    ``precision``: "bf16" | "fp16" (None, "fp32": none), ``loss_scale`` fp16's initial; ``zero``: 1, 2
    or 3 (ZeRO instead of DDP); ``comm_hook``: (state, hook) for DDP's buckets (the state is one rank's:
    give it on that rank, ``dataclasses.replace``); ``offload``: AdamW's state in host memory; ``live``:
    live recovery, the gradients averaged over each step's quorum of replica groups (True: every replica
    every step; a live job's member: its quorum, chapter 10); ``fp8``: an ``Fp8Recipe``;
    ``collective_matmul``: the sequence-parallel collectives overlapped with the GEMMs; ``cp_mode``:
    "ring" | "ulysses" | "hybrid" (``ulysses_size`` its Ulysses groups), ``layout``: the cp chunk
    assignment; ``moe``: ``moe_gpt``'s arguments, experts split over ep groups carved from dp;
    ``layer_costs``: one per layer, for a balanced cut."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    chunks: int = 1
    layer_costs: tuple | None = None
    sequence_parallel: bool = False
    collective_matmul: bool = False
    moe: dict | None = None
    cp_mode: str = "ring"
    ulysses_size: int | None = None
    layout: str = "zigzag"
    fp8: object = None
    recompute: str | None = None
    precision: str | None = None
    loss_scale: float | None = None
    zero: int | None = None
    comm_hook: tuple | None = None
    live: object = None
    optimizer: str = "sgd"
    lr: float = 0.1
    offload: bool = False
    checked: bool = field(default=False, compare=False, repr=False)  # set by parallelize.check only
    built_schedule: object = field(default=None, compare=False, repr=False)  # the pipeline's, when checked

    @classmethod
    def of(cls, **flags) -> Options:
        """``Options(**flags)``, with ``checkpoint=`` accepted for ``recompute=`` (its old name)."""
        if "checkpoint" in flags:
            flags["recompute"] = flags.pop("checkpoint")
        return cls(**flags)

    @property
    def mesh(self) -> dict:
        """The mesh sizes, as ``Mesh(comm, **options.mesh)`` takes them."""
        return dict(dp=self.dp, pp=self.pp, tp=self.tp, cp=self.cp, ep=self.ep)


def check_3d(world_size: int, cfg, batch_size: int | None, dp: int, pp: int, tp: int, microbatches: int,
             chunks: int = 1, rank: int = 0, cp: int = 1, seq_len: int | None = None, ep: int = 1,
             moe: dict | None = None) -> None:
    """Every error a mesh run can have, raised before any communication, naming what would be right
    (``batch_size`` / ``seq_len`` None: not known yet, not checked)."""
    for name, v in (("dp", dp), ("pp", pp), ("cp", cp), ("tp", tp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"rank {rank}: mesh size {name}={v!r} must be a positive integer")
    if dp * pp * cp * tp != world_size:
        shown = f"dp={dp} x pp={pp} x " + (f"cp={cp} x " if cp > 1 else "") + f"tp={tp}"
        raise ValueError(f"rank {rank}: mesh {shown} = {dp * pp * cp * tp} ranks, but the "
                         f"world has {world_size}; choose sizes whose product is {world_size}")
    if cp > 1 and seq_len is not None and seq_len % (2 * cp):
        raise ValueError(f"rank {rank}: sequence length {seq_len} does not split into 2 x cp = {2 * cp} "
                         f"zig-zag chunks; use a length that is a multiple of {2 * cp}")
    if cp > 1 and cfg.dropout:
        raise ValueError(f"rank {rank}: context parallelism needs dropout=0 (got {cfg.dropout})")
    if ep > 1 and (moe is None or dp % ep or moe["n_experts"] % ep):
        raise ValueError(f"rank {rank}: ep={ep} needs an MoE model (moe=dict(n_experts=...)) whose n_experts "
                         f"({None if moe is None else moe['n_experts']}) and dp ({dp}) it divides")
    layers = cfg.n_layer + 2  # Embed, blocks, Head
    if pp * chunks > layers:
        raise ValueError(f"rank {rank}: {pp * chunks} pipeline stages (pp={pp} x chunks={chunks}) but the "
                         f"GPT has only {layers} layers (embedding, {cfg.n_layer} blocks, head); "
                         f"use pp <= {layers}")
    if batch_size is not None and batch_size % (dp * microbatches):
        raise ValueError(f"rank {rank}: global batch {batch_size} does not split into dp={dp} replicas x "
                         f"{microbatches} microbatches; use a batch size that is a multiple of "
                         f"{dp * microbatches}")
    if tp > 1 and cfg.n_head % tp:
        raise ValueError(f"rank {rank}: n_head={cfg.n_head} is not divisible by tp={tp}")


def check_values(o: Options, cfg, built: bool = False, rank: int = 0) -> None:
    """Each flag's own value, and what a technique needs of the model or the mesh (a pair of
    techniques that cannot combine is the refusal table's, in ``parallelize``)."""
    if built and o.tp > 1:
        raise ValueError(f"rank {rank}: tp={o.tp} builds its own sharded model (TPGPT): pass the "
                         "GPTConfig, not a built GPT")
    if o.precision not in (None, "fp32", "bf16", "fp16"):
        raise ValueError(f"rank {rank}: precision={o.precision!r}; use None, 'bf16' or 'fp16'")
    if o.zero not in (None, 0, 1, 2, 3):
        raise ValueError(f"rank {rank}: zero={o.zero!r}; use None (DDP) or a ZeRO stage 1, 2 or 3")
    if o.offload and o.optimizer != "adamw":
        raise ValueError(f"rank {rank}: offload=True is OffloadedAdamW: use optimizer='adamw', "
                         f"not {o.optimizer!r}")
    if o.optimizer not in ("sgd", "adamw"):
        raise ValueError(f"rank {rank}: unknown optimizer {o.optimizer!r}: use 'sgd' or 'adamw'")
    if o.recompute not in (None, *POLICIES):
        raise ValueError(f"rank {rank}: recompute={o.recompute!r}; use None or one of {', '.join(POLICIES)}")
    if o.cp_mode not in CP_MODES:
        raise ValueError(f"rank {rank}: cp_mode={o.cp_mode!r}; use one of {', '.join(CP_MODES)}")
    if o.fp8 is not None and not isinstance(o.fp8, Fp8Recipe):
        raise ValueError(f"rank {rank}: fp8={o.fp8!r}; use None or an Fp8Recipe (e.g. Fp8Recipe('block'))")
    if o.fp8 is not None and np.dtype(cfg.dtype) != np.float32:
        raise ValueError(f"rank {rank}: fp8 needs an fp32 model (its weights are the master weights), got "
                         f"dtype={cfg.dtype!r}; use dtype='float32'")
    if o.fp8 is not None and o.fp8.scaling == "delayed" and o.pp > 1 and o.schedule == "dualpipe":
        raise ValueError(f"rank {rank}: fp8 delayed scaling with schedule='dualpipe': each of its two model "
                         "copies would keep its own amax history, from half of the microbatches, and the "
                         "copies would round alike no more; use Fp8Recipe('block') or 'current'")
    if o.live is not None and o.live is not True and not callable(getattr(o.live, "reduce", None)):
        raise ValueError(f"rank {rank}: live={o.live!r}; use None, True (every replica takes part in every "
                         "step) or a live job's quorum (minidist.resilience.live: an object with reduce(fn))")
    if o.collective_matmul and not (o.sequence_parallel and o.tp > 1):
        raise ValueError(f"rank {rank}: collective_matmul=True overlaps sequence parallelism's collectives; "
                         f"it needs sequence_parallel=True and tp > 1 (got sequence_parallel="
                         f"{o.sequence_parallel}, tp={o.tp})")
