"""The argument checks of ``parallelize``: every error raised before anything is built.

``check_3d`` holds the mesh errors (sizes, divisibility, what each technique needs of the model),
``techniques`` lists the composition-matrix techniques a call applies, so ``check_options`` can check
them pair by pair against ``compose`` (a refused pair is a ``ValueError`` naming both), together with
the option values. Each error names the rank and what would be right. Re-exported by
``minidist.parallel.parallelize``.
"""

from __future__ import annotations

import numpy as np

from minidist.parallel import compose
from minidist.parallel.context.model import MODES as CP_MODES
from minidist.parallel.memory.fp8 import Fp8Recipe


def check_3d(world_size: int, cfg, batch_size: int | None, dp: int, pp: int, tp: int, microbatches: int,
             chunks: int = 1, rank: int = 0, cp: int = 1, seq_len: int | None = None,
             checkpoint: str | None = None, ep: int = 1, moe: dict | None = None) -> None:
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
    if cp > 1 and checkpoint == "selective":
        raise ValueError(f"rank {rank}: context parallel (cp={cp}) cannot be combined with checkpointing "
                         f"(selective): {compose.rule('cp', 'ckpt-selective').reason}")
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


def techniques(mesh, sequence_parallel=False, checkpoint=None, precision=None, zero=None,
               offload=False, moe=None, fp8=None) -> list[str]:
    """The composition-matrix techniques a ``parallelize`` call applies, in its order."""
    out = ["tp"] if mesh.tp_size > 1 else []
    out += ["sp"] if sequence_parallel else []
    out += [] if moe is None else ["ep"]
    out += ["cp"] if mesh.cp_size > 1 else []
    out += [] if fp8 is None else ["fp8"]
    out += ["pp"] if mesh.pp_size > 1 else []
    out += [] if checkpoint is None else ["ckpt-selective" if checkpoint == "selective" else "ckpt-full"]
    out += [] if precision in (None, "fp32") else [precision]
    out += [f"zero{zero}"] if zero else (["ddp"] if mesh.dp_size * mesh.cp_size > 1 else [])
    return out + (["offload"] if offload else [])


def check_options(mesh, cfg, built: bool, *, microbatches, chunks, sequence_parallel, moe, checkpoint,
                  precision, zero, offload, comm_hook, fp8, collective_matmul, cp_mode) -> None:
    """Every argument error of a ``parallelize`` call, raised before anything is built: the mesh
    (``check_3d``), the option values, and each pair of techniques against ``compose``'s matrix."""
    rank, dp, cp = mesh.world.rank, mesh.dp_size, mesh.cp_size
    check_3d(mesh.world.size, cfg, None, dp, mesh.pp_size, mesh.tp_size, microbatches, chunks, rank, cp,
             None, checkpoint, mesh.ep_size, moe)
    if built and mesh.tp_size > 1:
        raise ValueError(f"rank {rank}: tp={mesh.tp_size} builds its own sharded model (TPGPT): pass the "
                         "GPTConfig, not a built GPT")
    if precision not in (None, "fp32", "bf16", "fp16"):
        raise ValueError(f"rank {rank}: precision={precision!r}; use None, 'bf16' or 'fp16'")
    if zero not in (None, 0, 1, 2, 3):
        raise ValueError(f"rank {rank}: zero={zero!r}; use None (DDP) or a ZeRO stage 1, 2 or 3")
    if zero and comm_hook is not None:
        raise ValueError(f"rank {rank}: comm_hook is a hook on DDP's all-reduced buckets; ZeRO "
                         f"(zero={zero}) reduce-scatters them: pass comm_hook=None or use DDP")
    compose.check_pairs(techniques(mesh, sequence_parallel, checkpoint, precision, zero, offload, moe, fp8))
    _check_fp8_overlap_cp(rank, cfg, fp8, collective_matmul, sequence_parallel, mesh.tp_size, cp_mode)


def _check_fp8_overlap_cp(rank, cfg, fp8, collective_matmul, sequence_parallel, tp, cp_mode) -> None:
    """FP8's recipe and fp32 model; collective matmul's sequence-parallel TP; the context-parallel mode."""
    if cp_mode not in CP_MODES:
        raise ValueError(f"rank {rank}: cp_mode={cp_mode!r}; use one of {', '.join(CP_MODES)}")
    if fp8 is not None and not isinstance(fp8, Fp8Recipe):
        raise ValueError(f"rank {rank}: fp8={fp8!r}; use None or an Fp8Recipe (e.g. Fp8Recipe('block'))")
    if collective_matmul and not (sequence_parallel and tp > 1):
        raise ValueError(f"rank {rank}: collective_matmul=True overlaps sequence parallelism's collectives; "
                         f"it needs sequence_parallel=True and tp > 1 (got sequence_parallel="
                         f"{sequence_parallel}, tp={tp})")
    if collective_matmul and fp8 is not None:
        raise ValueError(f"rank {rank}: collective_matmul=True with fp8: the FP8 wrappers run the "
                         "sequence-parallel collectives unfused; use one of them")
    if fp8 is not None and np.dtype(cfg.dtype) != np.float32:
        raise ValueError(f"rank {rank}: fp8 needs an fp32 model (its weights are the master weights), got "
                         f"dtype={cfg.dtype!r}; use dtype='float32'")
