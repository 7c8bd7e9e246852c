"""The basic layers: Linear, Embedding, LayerNorm, Dropout, MLP.

Constructors take the dtype explicitly and draw initial weights from a seeded NumPy generator
(``rng``, default: this rank's ``minidist.autograd.random`` generator) so that a model built twice with
the same seed is the same model on every backend and every rank.
"""

from __future__ import annotations

import numpy as np

from minidist.accel.backend import default_backend, get_backend
from minidist.autograd import ops
from minidist.autograd import random as mrandom
from minidist.nn.module import Module, Parameter


def init_normal(shape, std, dtype, rng=None, backend=None) -> Parameter:
    be = get_backend(backend) if backend is not None else default_backend()
    rng = rng if rng is not None else mrandom.default_generator()
    return Parameter(be.random_normal(rng, shape, dtype, scale=std))


def init_constant(shape, value, dtype, backend=None) -> Parameter:
    be = get_backend(backend) if backend is not None else default_backend()
    return Parameter(be.from_host(np.full(shape, value, dtype=dtype)))


class Linear(Module):
    """y = x @ weight + bias, weight of shape (in_features, out_features), init N(0, std²)."""

    def __init__(self, in_features, out_features, bias=True, *, dtype=np.float32, std=None, rng=None,
                 backend=None):
        super().__init__()
        std = (1.0 / np.sqrt(in_features)) if std is None else std
        self.in_features, self.out_features = in_features, out_features
        self.weight = init_normal((in_features, out_features), std, dtype, rng, backend)
        self.bias = init_constant((out_features,), 0.0, dtype, backend) if bias else None

    def forward(self, x, product=None):
        """``product(x, weight, bias)``: the GEMM, ``ops.linear`` unless a forward wrapper passes another."""
        return (product or ops.linear)(x, self.weight, self.bias)


class Embedding(Module):
    def __init__(self, num_embeddings, dim, *, dtype=np.float32, std=0.02, rng=None, backend=None):
        super().__init__()
        self.weight = init_normal((num_embeddings, dim), std, dtype, rng, backend)

    def forward(self, idx):
        return ops.embedding(self.weight, idx)


class LayerNorm(Module):
    def __init__(self, dim, eps=1e-5, *, dtype=np.float32, backend=None):
        super().__init__()
        self.eps = eps
        self.weight = init_constant((dim,), 1.0, dtype, backend)
        self.bias = init_constant((dim,), 0.0, dtype, backend)

    def forward(self, x):
        return ops.layer_norm(x, self.weight, self.bias, self.eps)


class Dropout(Module):
    """Drops with probability p in training mode, from this rank's ``minidist.autograd.random`` generator."""

    def __init__(self, p=0.0):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"Dropout probability must be in [0, 1), got {p}")
        self.p = p

    def forward(self, x):
        return ops.dropout(x, self.p, mrandom.default_generator(), self.training)


class MLP(Module):
    """Linear(d, 4d) -> GELU -> Linear(4d, d) -> dropout: the transformer's feed-forward block."""

    def __init__(self, dim, hidden=None, dropout=0.0, *, dtype=np.float32, std=0.02, proj_std=None,
                 rng=None, backend=None):
        super().__init__()
        hidden = hidden or 4 * dim
        self.fc = Linear(dim, hidden, dtype=dtype, std=std, rng=rng, backend=backend)
        self.proj = Linear(hidden, dim, dtype=dtype, std=proj_std or std, rng=rng, backend=backend)
        self.drop = Dropout(dropout)

    def forward(self, x):
        return self.drop(self.proj(ops.gelu(self.fc(x))))
