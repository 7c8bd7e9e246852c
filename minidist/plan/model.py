"""What the planner knows about a model: its shape, parameter count, FLOPs and activation bytes.

A `ModelSpec` is a decoder-only transformer: `n_layer` blocks of attention (n_head query heads,
`kv_heads` key/value heads) and an MLP (`ffn` hidden units; `gated` = SwiGLU's three matrices),
optionally a mixture of experts (`experts` MLPs per MoE layer, `top_k` of them per token, every
`moe_every`-th layer), an embedding of `vocab` rows and an LM head.

Two *engines* say what a rank actually stores, because the planner must be exact where it can:
``"minidist"`` (this library's `minidist.nn.GPT`, float32, activations counted op by op:
`minidist_block_elements`, what `minidist.nn.footprint.MemoryAccountant` measures) and
``"megatron"`` (bf16 mixed precision with fused kernels, activations per layer from Korthikanti et
al. 2022). FLOPs count 2 per multiply-add of every matmul (Narayanan et al. 2021's formula,
generalised); backward costs twice the forward, and model FLOPs never count recomputation. The
formulas and their sources: chapter 11 (lessons/11-planning.md, "The model of cost").
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class ModelSpec:
    name: str
    n_layer: int
    d_model: int
    n_head: int
    vocab: int
    seq: int
    ffn: int | None = None          # MLP hidden size (default 4 * d_model)
    kv_heads: int | None = None     # grouped-query attention (default n_head)
    head_size: int | None = None    # per-head dimension (default d_model // n_head; PaLM: 256)
    gated: bool = False             # SwiGLU: 3 matrices in the MLP instead of 2
    experts: int = 1                # MLPs per MoE layer (1 = dense)
    top_k: int = 1                  # experts each token visits
    moe_every: int = 1              # every k-th layer is MoE (when experts > 1)
    tied_embeddings: bool = False
    engine: str = "megatron"        # "megatron" (bf16 + fp32 master) or "minidist" (this library)
    flash_attention: bool = False   # no s x s scores kept (FlashAttention)
    dtype_bytes: int = 2            # activations and weights as computed
    notes: tuple = field(default=(), compare=False)  # assumptions, each with its source

    def __post_init__(self):
        if self.d_model % self.n_head:
            raise ValueError(f"{self.name}: d_model {self.d_model} not divisible by n_head {self.n_head}")
        if self.engine not in ("megatron", "minidist"):
            raise ValueError(f"{self.name}: engine must be 'megatron' or 'minidist', got {self.engine!r}")

    @classmethod
    def of_gpt(cls, name: str, cfg) -> ModelSpec:
        """The spec of minidist's own GPT of ``cfg`` (a ``GPTConfig``), trained in float32."""
        return cls(name, n_layer=cfg.n_layer, d_model=cfg.d_model, n_head=cfg.n_head, vocab=cfg.vocab_size,
                   seq=cfg.block_size, engine="minidist", dtype_bytes=4,
                   kv_heads=getattr(cfg, "n_kv_head", None))

    def replace(self, **kw) -> ModelSpec:
        return replace(self, **kw)

    # -- shape ------------------------------------------------------------------------------------
    @property
    def hidden(self) -> int:
        return self.ffn or 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.head_size or self.d_model // self.n_head

    @property
    def kv(self) -> int:
        return self.kv_heads or self.n_head

    def is_moe(self, layer: int) -> bool:
        return self.experts > 1 and layer % self.moe_every == self.moe_every - 1

    @property
    def moe_layers(self) -> int:
        return sum(self.is_moe(i) for i in range(self.n_layer))

    # -- parameters -------------------------------------------------------------------------------
    def attn_params(self) -> int:
        h, d = self.d_model, self.head_dim
        qkv = self.n_head * d + 2 * self.kv * d
        w = h * qkv + self.n_head * d * h
        return w + (qkv + h if self.engine == "minidist" else 0)  # minidist: the qkv bias + proj bias h

    def mlp_params(self) -> int:
        h, f = self.d_model, self.hidden
        w = (3 if self.gated else 2) * h * f
        return w + (f + h if self.engine == "minidist" else 0)

    def norm_params(self) -> int:
        return (4 if self.engine == "minidist" else 2) * self.d_model  # minidist LayerNorm: weight + bias

    def layer_params(self, layer: int, active: bool = False) -> int:
        """Parameters of block `layer` (active=True: only the top_k experts a token uses)."""
        if self.is_moe(layer):
            n = (self.top_k if active else self.experts) * self.mlp_params() + self.d_model * self.experts
        else:
            n = self.mlp_params()
        return self.attn_params() + n + self.norm_params()

    def embed_params(self) -> int:
        pos = self.seq * self.d_model if self.engine == "minidist" else 0  # learned positions
        return self.vocab * self.d_model + pos

    def head_params(self) -> int:
        norm = (2 if self.engine == "minidist" else 1) * self.d_model
        return norm + (0 if self.tied_embeddings else self.vocab * self.d_model)

    def params(self, active: bool = False) -> int:
        return (self.embed_params() + self.head_params()
                + sum(self.layer_params(i, active) for i in range(self.n_layer)))

    # -- FLOPs ------------------------------------------------------------------------------------
    def layer_matmul_params(self, layer: int) -> int:
        """Weights a token multiplies by in block `layer` (active experts only, router included)."""
        h, d = self.d_model, self.head_dim
        attn = h * (self.n_head * d + 2 * self.kv * d) + self.n_head * d * h
        mlp = (3 if self.gated else 2) * h * self.hidden
        if self.is_moe(layer):
            mlp = self.top_k * mlp + h * self.experts
        return attn + mlp

    def layer_forward_flops(self, layer: int, tokens: int) -> float:
        """Forward FLOPs of block `layer` on `tokens` tokens of sequences of length `seq`:
        2 per multiply-add of the weights, plus 4·s·h per token for q·kᵀ and p·v (not halved for the
        causal mask, as Megatron-LM and PaLM count)."""
        attention = 4.0 * tokens * self.seq * self.n_head * self.head_dim
        return 2.0 * tokens * self.layer_matmul_params(layer) + attention

    def head_forward_flops(self, tokens: int) -> float:
        return 2.0 * tokens * self.d_model * self.vocab

    def model_flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward = 3x forward), no recomputation: the numerator
        of MFU. For a dense MHA model with ffn = 4h this is 72·l·h²(1 + s/6h + V/12lh) -- the
        Megatron-LM formula without its recomputation term."""
        fwd = sum(self.layer_forward_flops(i, 1) for i in range(self.n_layer)) + self.head_forward_flops(1)
        return 3.0 * fwd

    # -- activations (bytes one microbatch of b sequences leaves saved for backward) ---------------
    def layer_activation_bytes(self, layer: int, b: int, tp: int = 1, cp: int = 1,
                               policy: str = "none", sequence_parallel: bool = True) -> float:
        """Bytes block `layer` keeps for backward on one rank, for b sequences of length seq/cp."""
        s = self.seq // cp
        if self.engine == "minidist":
            parts = minidist_block_elements(b, s, self.d_model, self.n_head, tp)
            if policy == "none":
                return self.dtype_bytes * sum(parts.values())
            raise ValueError("minidist engine: use block_peak_elements for checkpointing policies")
        h, a = self.d_model, self.n_head
        sbh = s * b * h
        if policy == "full":
            return 2.0 * sbh / (tp if sequence_parallel else 1)  # only the block's input (bf16)
        # Korthikanti et al. Table 2 (bytes, bf16): replicated 10·sbh (layer-norm inputs 4, qkv and
        # MLP inputs 2 + 2, two dropout masks 1 + 1); split by tp 24·sbh (q, k, v 6, proj input 2,
        # GELU input and output 16); attention scores 5·a·s·sbh/h. Generalised: k and v scale by
        # kv_heads/n_head, the MLP by ffn/4h (x1.5 gated, x top_k in MoE layers).
        mlp = 16.0 * self.hidden / (4 * h) * (1.5 if self.gated else 1.0)
        if self.is_moe(layer):
            mlp *= self.top_k
        split = 4.0 + 4.0 * self.kv / self.n_head + mlp
        scores = 0.0 if (policy == "selective" or self.flash_attention) else 5.0 * a * s / h
        if sequence_parallel:
            return sbh * ((10.0 + split) / tp + scores / tp)
        return sbh * (10.0 + split / tp + scores / tp)


def minidist_block_elements(b: int, s: int, h: int, heads: int, tp: int = 1) -> dict:
    """Elements one `minidist.nn.gpt.Block` (or, for tp > 1, `ParallelBlock`) saves for backward,
    op by op, without dropout (see `minidist.parallel.memory.recompute.block_activation_elements`, the
    serial count). Replicated on every tensor-parallel rank: ln1 x̂ + rstd, the qkv linear's input,
    ln2 x̂ + rstd, the fc linear's input. Split by tp: the qkv output (q, k, v views of one buffer),
    the attention probabilities, the proj linear's input, GELU's x and tanh, the mlp proj's input."""
    bsh, bs = b * s * h, b * s
    return {
        "ln1": bsh + bs, "qkv_in": bsh, "qkv_out": 3 * bsh // tp, "probs": b * (heads // tp) * s * s,
        "proj_in": bsh // tp, "ln2": bsh + bs, "fc_in": bsh, "gelu": 8 * bsh // tp,
        "mlp_proj_in": 4 * bsh // tp,
    }


def minidist_head_elements(b: int, s: int, h: int, vocab: int, tp: int = 1) -> int:
    """The minidist GPT's Head + loss: final LayerNorm (x̂ + rstd), the LM head's input, and the
    cross-entropy's saved logits (serial: shifted logits + log-sum-exp; tp > 1: the vocabulary
    shard of the shifted logits + the per-token log-sum-exp)."""
    return (b * s * h + b * s) + b * s * h + b * s * vocab // tp + b * s


def minidist_embed_elements(b: int, s: int, tp: int = 1) -> int:
    """The embedding saves nothing serially (a lookup's gradient needs only the ids); the
    vocabulary-parallel one multiplies its rows by an in-range mask (b, s, 1), which it keeps."""
    return b * s if tp > 1 else 0
