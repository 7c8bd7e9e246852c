"""A GPT decoder: token + learned position embeddings, pre-norm blocks, final norm, LM head.

The model is a flat sequence of layers -- ``Embed``, ``Block`` × n_layer, ``Head`` -- so pipeline
parallelism can cut it into stages anywhere, and ``GPT.forward`` is just that sequence applied in
order. Initialisation follows GPT-2: N(0, 0.02), residual projections scaled by 1/√(2·n_layer),
drawn in a fixed order from ``numpy.random.default_rng(config.seed)``. ``n_kv_head`` < ``n_head``:
grouped-query attention (``minidist.nn.attention``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from minidist.autograd import ops
from minidist.autograd.tensor import Tensor
from minidist.nn.attention import CausalSelfAttention, check_heads
from minidist.nn.layers import MLP, Dropout, Embedding, LayerNorm, Linear
from minidist.nn.module import Module, Sequential


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 128  # the longest context
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 256
    dropout: float = 0.0
    dtype: str = "float32"
    seed: int = 0
    n_kv_head: int | None = None  # key/value heads (grouped-query attention); None: n_head

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"GPTConfig.{name} must be an integer, got {v!r}")
            if v < (0 if name == "seed" else 1):
                raise ValueError(f"GPTConfig.{name} must be >= {0 if name == 'seed' else 1}, got {v}")
        check_heads(self.d_model, self.n_head, self.n_kv_head, "GPTConfig")
        if not (isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0):
            raise ValueError(f"GPTConfig.dropout must be a probability in [0, 1), got {self.dropout!r}")
        try:
            kind = np.dtype(self.dtype).kind
        except TypeError:
            kind = None
        if kind != "f":
            raise TypeError(f"GPTConfig.dtype must be a float dtype such as 'float32' or 'float64', "
                            f"got {self.dtype!r}")

    @property
    def kv_heads(self) -> int:
        """The number of key/value heads: ``n_kv_head``, or ``n_head`` when it is None."""
        return self.n_head if self.n_kv_head is None else int(self.n_kv_head)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def replace(self, **changes) -> GPTConfig:
        return replace(self, **changes)


class Embed(Module):
    """Token ids (B, T) -> token embedding + position embedding -> dropout, (B, T, C)."""

    def __init__(self, cfg: GPTConfig, rng, backend=None):
        super().__init__()
        dt = np.dtype(cfg.dtype)
        self.block_size = cfg.block_size
        self.wte = Embedding(cfg.vocab_size, cfg.d_model, dtype=dt, rng=rng, backend=backend)
        self.wpe = Embedding(cfg.block_size, cfg.d_model, dtype=dt, rng=rng, backend=backend)
        self.drop = Dropout(cfg.dropout)

    def forward(self, idx, start: int = 0, positions=None):
        """Tokens at positions start .. start+T-1, or at ``positions`` (B, T): each sequence's own
        (KV-cached decoding: every sequence continues from its own length)."""
        idx = token_ids(idx, start, self.block_size)
        # host positions (the lookup moves ids to the table's device): on JAX a device arange is a
        # compiled program and the embedding's range check of device ids a read-back to the host
        pos = np.arange(start, start + idx.shape[1]) if positions is None else positions
        return self.drop(self.wte(idx) + self.wpe(pos))


def token_ids(idx, start: int, block_size: int):
    """The id array (B, T) of ``idx`` (an array or a Tensor), checked to fit the context from ``start``."""
    idx = idx.data if isinstance(idx, Tensor) else idx
    if getattr(idx, "ndim", None) != 2 or idx.shape[0] < 1 or idx.shape[1] < 1:
        raise ValueError(f"token ids must be an array of shape (batch, time), both >= 1, got shape "
                         f"{getattr(idx, 'shape', type(idx).__name__)}")
    t = idx.shape[1]
    if start + t > block_size:
        raise ValueError(f"sequence of length {start + t} is longer than the context "
                         f"(block_size {block_size})")
    return idx


class Block(Module):
    """x + attn(ln1(x)), then + mlp(ln2(x)): a pre-norm transformer block. ``cache``: this layer's
    view of a KV cache (inference; see ``minidist.nn.attention.self_attention``)."""

    def __init__(self, cfg: GPTConfig, rng, backend=None):
        super().__init__()
        dt = np.dtype(cfg.dtype)
        proj_std = 0.02 / math.sqrt(2 * cfg.n_layer)
        self.ln1 = LayerNorm(cfg.d_model, dtype=dt, backend=backend)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.n_head, cfg.dropout, dtype=dt, proj_std=proj_std,
                                        rng=rng, backend=backend, n_kv_head=cfg.kv_heads)
        self.ln2 = LayerNorm(cfg.d_model, dtype=dt, backend=backend)
        self.mlp = MLP(cfg.d_model, dropout=cfg.dropout, dtype=dt, proj_std=proj_std, rng=rng,
                       backend=backend)

    def forward(self, x, cache=None):
        x = x + self.attn(self.ln1(x), cache=cache)
        return x + self.mlp(self.ln2(x))


class Head(Module):
    """Final LayerNorm and the projection to vocabulary logits."""

    def __init__(self, cfg: GPTConfig, rng, backend=None):
        super().__init__()
        dt = np.dtype(cfg.dtype)
        self.ln = LayerNorm(cfg.d_model, dtype=dt, backend=backend)
        self.proj = Linear(cfg.d_model, cfg.vocab_size, bias=False, dtype=dt, std=0.02, rng=rng,
                           backend=backend)

    def forward(self, x):
        return self.proj(self.ln(x))


class GPT(Sequential):
    """Embed, n_layer Blocks, Head. ``model(idx)`` gives logits (B, T, vocab)."""

    def __init__(self, cfg: GPTConfig, backend=None):
        super().__init__()
        object.__setattr__(self, "config", cfg)
        rng = np.random.default_rng(cfg.seed)
        self.append(Embed(cfg, rng, backend))
        for _ in range(cfg.n_layer):
            self.append(Block(cfg, rng, backend))
        self.append(Head(cfg, rng, backend))

    def loss(self, idx, targets):
        """Mean cross-entropy of next-token ``targets`` (B, T); -1 marks positions to ignore."""
        if np.shape(targets) != np.shape(idx):
            raise ValueError(f"GPT.loss: targets must have the token ids' shape {np.shape(idx)} (B, T), "
                             f"got {np.shape(targets)}")
        return ops.cross_entropy(self(idx), targets)
