"""Named models and the published training runs the planner is checked against, with their sources.

Every number below comes from the paper named beside it; where a paper is silent, the assumption
is written in `notes`. `RUNS` are the published runs: model, hardware, chips, the mesh they used
and what they reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minidist.plan import hardware
from minidist.plan.model import ModelSpec

MEG21 = "Narayanan et al. 2021, Efficient Large-Scale LM Training on GPU Clusters Using Megatron-LM, Table 1"

GPT3_175B = ModelSpec(
    "gpt3-175b", n_layer=96, d_model=12288, n_head=96, vocab=51200, seq=2048,
    notes=("shape: Brown et al. 2020 (GPT-3) Table 2.1; vocab 51,200 (padded) and seq 2048 as in " + MEG21,))
GPT_1T = ModelSpec(
    "gpt-1t", n_layer=128, d_model=25600, n_head=160, vocab=51200, seq=2048,
    notes=("shape: " + MEG21 + " (1,008B parameters)",))
_LLAMA = dict(vocab=128256, seq=8192, gated=True, kv_heads=8, flash_attention=True, tied_embeddings=False)
_LLAMA_SRC = "Llama Team 2024, The Llama 3 Herd of Models, Table 3 (SwiGLU, GQA with 8 KV heads, vocab 128K)"
LLAMA3_8B = ModelSpec("llama3-8b", n_layer=32, d_model=4096, n_head=32, ffn=14336, notes=(_LLAMA_SRC,),
                      **_LLAMA)
LLAMA3_70B = ModelSpec("llama3-70b", n_layer=80, d_model=8192, n_head=64, ffn=28672, notes=(_LLAMA_SRC,),
                       **_LLAMA)
LLAMA3_405B = ModelSpec("llama3-405b", n_layer=126, d_model=16384, n_head=128, ffn=53248, notes=(_LLAMA_SRC,),
                        **_LLAMA)
PALM_540B = ModelSpec(
    "palm-540b", n_layer=118, d_model=18432, n_head=48, head_size=256, kv_heads=1, ffn=73728, gated=True,
    vocab=256000, seq=2048, tied_embeddings=True,
    notes=("Chowdhery et al. 2022 (PaLM) Table 1 and Sec. 2: SwiGLU with d_ff = 4 d_model, multi-query "
           "attention (1 KV head), head size 256, shared input/output embedding, vocab 256K -> 540.3B",))
GEMINI_LIKE_MOE = ModelSpec(
    "gemini-like-moe", n_layer=64, d_model=8192, n_head=64, kv_heads=8, ffn=24576, gated=True,
    experts=64, top_k=2, moe_every=2, vocab=256000, seq=8192, flash_attention=True,
    notes=("ASSUMED: Gemini's architecture is unpublished beyond 'a sparse mixture-of-experts Transformer' "
           "(Gemini Team 2024, Gemini 1.5 report, Sec. 2). This preset is a GLaM/Switch-style MoE: 64 "
           "layers, every other one with 64 experts, top-2 routing (Du et al. 2022, GLaM), d_model 8192, "
           "GQA, SwiGLU, Gemma's 256K vocabulary (Gemma Team 2024). ~1.27T parameters, 72B active a token.",))

MODELS = {m.name: m for m in (GPT3_175B, GPT_1T, LLAMA3_8B, LLAMA3_70B, LLAMA3_405B, PALM_540B,
                              GEMINI_LIKE_MOE)}


@dataclass(frozen=True)
class PublishedRun:
    """A training run as its paper describes it, and the number it reports."""
    name: str
    model: ModelSpec
    hardware: hardware.Hardware
    chips: int
    global_batch: int                 # sequences per step
    mesh: dict                        # dp, tp, pp, zero, checkpoint, microbatch_size, schedule, chunks
    metric: str                       # "tflops_per_chip" (paper's formula, recompute counted) or "mfu"
    reported: float                   # TFLOP/s per chip, or MFU as a fraction
    reported_range: tuple = ()        # (low, high) when the paper gives a range
    source: str = ""
    notes: tuple = field(default=())


RUNS = {
    "megatron-1t": PublishedRun(
        "megatron-1t", GPT_1T, hardware.A100, 3072, 3072,
        dict(dp=6, tp=8, pp=64, zero=0, checkpoint="full", microbatch_size=1, schedule="1f1b"),
        "tflops_per_chip", 163.0, source=MEG21,
        notes=("t=8, p=64, d=6, batch 3072, 163 TFLOP/s per GPU (52% of peak): " + MEG21,
               "microbatch 1 and full activation recomputation: Sec. 5 ('we use activation recomputation')",
               "ASSUMED: plain 1F1B (Table 1 does not say which rows use the interleaved schedule)",
               "throughput counts recomputation: 96·B·s·l·h²(1 + s/6h + V/16lh) FLOPs per step (eq. 3)")),
    "gpt3-175b": PublishedRun(
        "gpt3-175b", GPT3_175B, hardware.A100, 1536, 1536,
        dict(dp=12, tp=8, pp=16, zero=0, checkpoint="full", microbatch_size=1, schedule="1f1b"),
        "tflops_per_chip", 153.0, source=MEG21,
        notes=("t=8, p=16, d=12, batch 1536, 153 TFLOP/s per GPU: " + MEG21,
               "ASSUMED: microbatch 1, full recomputation, plain 1F1B, as for the 1T row")),
    "palm-540b": PublishedRun(
        "palm-540b", PALM_540B, hardware.TPU_V4.with_(chips_per_domain=3072), 6144, 2048,
        dict(dp=512, tp=12, pp=1, zero=3, checkpoint="full", microbatch_size=4, schedule="1f1b"),
        "mfu", 0.462, source="Chowdhery et al. 2022, PaLM, Sec. 4 and Table 3 (46.2% MFU)",
        notes=("2 pods x 3072 TPU v4 chips; 12-way model parallel x 256-way fully sharded data parallel "
               "inside a pod, 2-way data parallel across pods over DCN; no pipeline (Sec. 4)",
               "batch 2048 sequences of 2048 tokens (the largest of its batch schedule, Sec. 5)",
               "rematerialization on (Sec. 4.1: 57.8% hardware FLOPs utilization with it); "
               "ASSUMED: 4 sequences per chip per forward (2048 / 512 data-parallel replicas)")),
    "llama3-405b": PublishedRun(
        "llama3-405b", LLAMA3_405B, hardware.H100, 16384, 2048,
        dict(dp=128, tp=8, pp=16, zero=1, checkpoint="full", microbatch_size=1, schedule="interleaved",
             chunks=4),
        "mfu", 0.41, reported_range=(0.38, 0.43),
        source="Llama Team 2024, The Llama 3 Herd of Models, Table 4 "
               "(16,384 GPUs: 41% BF16 MFU; 38-43% overall)",
        notes=("TP 8, CP 1, PP 16, DP 128, seq 8192, 16M tokens per batch = 2048 sequences, batch 16 "
               "sequences per DP rank (Table 4)",
               "ASSUMED: microbatch 1, interleaved 1F1B with 4 chunks per stage (Sec. 3.3.2 describes an "
               "interleaved schedule without giving v), optimizer state sharded over DP (FSDP, Sec. 3.3.2)",
               "ASSUMED: full activation recomputation -- the paper does not say, and without it this mesh "
               "needs ~85 GB per GPU by the planner's count (Korthikanti et al. 2022 activations)")),
}
