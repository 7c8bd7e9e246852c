"""Causal multi-head self-attention.

x (B, T, C) -> qkv = x @ W_qkv (B, T, 3C) -> q, k, v as (B, H, T, C/H) -> fused causal
scaled-dot-product attention -> merge heads (B, T, C) -> output projection -> dropout.
``split_heads`` and ``merge_heads`` are separate so that tensor parallelism (heads split across
ranks) and the KV cache (keys and values kept between decode steps) can reuse them.
"""

from __future__ import annotations

import numpy as np

from minidist import ops
from minidist.nn.layers import Dropout, Linear
from minidist.nn.module import Module


def split_heads(qkv, n_head):
    """(B, T, 3·H·D) -> three tensors (B, H, T, D)."""
    b, t, three_c = qkv.shape
    d = three_c // (3 * n_head)
    qkv = qkv.reshape(b, t, 3, n_head, d).transpose(2, 0, 3, 1, 4)
    return qkv[0], qkv[1], qkv[2]


def merge_heads(y):
    """(B, H, T, D) -> (B, T, H·D)."""
    b, h, t, d = y.shape
    return y.transpose(0, 2, 1, 3).reshape(b, t, h * d)


class CausalSelfAttention(Module):
    def __init__(self, dim, n_head, dropout=0.0, *, dtype=np.float32, std=0.02, proj_std=None, rng=None,
                 backend=None):
        super().__init__()
        if dim % n_head:
            raise ValueError(f"d_model {dim} is not divisible by n_head {n_head}")
        self.n_head = n_head
        self.qkv = Linear(dim, 3 * dim, dtype=dtype, std=std, rng=rng, backend=backend)
        self.proj = Linear(dim, dim, dtype=dtype, std=proj_std or std, rng=rng, backend=backend)
        self.drop = Dropout(dropout)

    def forward(self, x):
        q, k, v = split_heads(self.qkv(x), self.n_head)
        y = ops.scaled_dot_product_attention(q, k, v, causal=True)
        return self.drop(self.proj(merge_heads(y)))
