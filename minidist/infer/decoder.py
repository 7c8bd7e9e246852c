"""The inference forward pass: the training model's own layers, run over a KV cache.

Serving runs the modules training runs -- ``Embed``, each ``Block`` (or ``ParallelBlock``), ``Head``
-- with one more argument: ``block(x, cache=step.layer(i))``, whose attention stores the new keys and
values and attends to everything cached. A ``Decoder`` says which layers a rank serves with (a whole
GPT, or one pipeline stage's tensor-parallel shards: ``sharded.py``). ``forward_tokens(decoder,
cache, slots, token_lists)`` covers prefill, decode, a mix of both and chunked prompts: sequence b's
tokens sit at positions ``cache.lengths[slot_b] + t``, rows are padded to the longest, and the
cache's mask hides per sequence, so different lengths never mix.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minidist.autograd.tensor import Tensor, no_grad
from minidist.infer.buckets import bucket
from minidist.infer.kv_cache import CacheStep
from minidist.nn.module import Module
from minidist.parallel.tensor.shard import local_kv_heads


@dataclass
class Decoder:
    """The layers one rank serves with: ``blocks`` (training's modules), the ``embed`` layer on the
    first pipeline stage, the ``head`` on the last; ``tp``: the attention heads are split over that
    many ranks (the KV cache holds this rank's K/V heads: ``cache_dims``)."""

    config: object  # the GPTConfig
    blocks: list
    embed: Module | None = None
    head: Module | None = None
    tp: int = 1

    def __post_init__(self):
        layers = [m for m in (self.embed, *self.blocks, self.head) if m is not None]
        if self.config.dropout > 0 and any(m.training for m in layers):
            raise ValueError(f"the model has dropout {self.config.dropout} and is in training mode: call "
                             "model.eval() before generating (dropout would drop activations)")

    @classmethod
    def from_model(cls, model) -> Decoder:
        """A whole ``minidist.nn.GPT``: the layer list Embed, Block × n_layer, Head (``GPT``'s layout,
        the one pipeline stages cut)."""
        layers = list(model)
        return cls(model.config, layers[1:-1], embed=layers[0], head=layers[-1])

    block_size = property(lambda self: self.config.block_size)
    vocab_size = property(lambda self: self.config.vocab_size)

    @property
    def cache_dims(self) -> tuple:
        """(layers here, K/V heads here, head_dim): the KV cache's shape per slot and position.
        Grouped-query attention caches n_kv_head heads, split over tp or replicated
        (``local_kv_heads``); multi-head attention n_head / tp."""
        cfg = self.config
        kv = local_kv_heads(cfg.n_head, getattr(cfg, "kv_heads", cfg.n_head), self.tp)
        return len(self.blocks), kv, cfg.d_model // cfg.n_head

    @property
    def whole(self) -> bool:
        """All of the model on this rank (no tensor or pipeline split): nothing is sent."""
        return self.tp == 1 and self.embed is not None and self.head is not None

    @property
    def first_parameter(self):
        layers = [m for m in (self.embed, *self.blocks, self.head) if m is not None]
        return next(p for m in layers for p in m.parameters())


def as_decoder(model) -> Decoder:
    return model if isinstance(model, Decoder) else Decoder.from_model(model)


def pack(token_lists, starts, block_size, bucketed=False):
    """Pad ragged token lists into arrays: ids (B, T), positions (B, T), valid (B, T), lengths (B,).
    ``bucketed`` (JAX): T padded further, to the next power of two, so prompts of many lengths make
    few shapes (padding is never written to the cache, and its outputs are not read)."""
    lens = np.array([len(t) for t in token_lists], dtype=np.int64)
    b, t = len(token_lists), int(lens.max())
    t = bucket(t, block_size) if bucketed else t
    if t == 1:  # decoding: one token per sequence, nothing to pad
        ids = np.array(token_lists, dtype=np.int64)
    else:
        ids = np.zeros((b, t), dtype=np.int64)
        for i, toks in enumerate(token_lists):
            ids[i, :len(toks)] = toks
    pos = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(t)[None, :]
    valid = np.arange(t)[None, :] < lens[:, None]
    if int(pos[valid].max()) >= block_size:
        row = int(np.argmax((pos * valid).max(axis=1)))
        raise ValueError(f"sequence {row} would reach position {int((pos * valid)[row].max())}, past the "
                         f"context (block_size {block_size}); keep prompt + new tokens <= {block_size}")
    return ids, np.minimum(pos, block_size - 1), valid, lens


def forward_tokens(decoder: Decoder, cache, slots, token_lists, x=None):
    """Feed each sequence's new tokens; returns logits (B, T, V) (or hidden states on a non-last stage).

    ``slots[b]`` is sequence b's row in ``cache``; its tokens go at positions
    ``cache.lengths[slot] ...``; afterwards the lengths advance. ``x``: hidden states from the
    previous pipeline stage (instead of embedding the tokens).
    """
    slots = np.asarray(slots, dtype=np.int64)
    if len(token_lists) == 0 or len(token_lists) != len(slots):
        raise ValueError(f"forward_tokens: {len(token_lists)} token lists for {len(slots)} slots "
                         "(need one list per slot, at least one)")
    if any(len(t) == 0 for t in token_lists):
        raise ValueError("forward_tokens: an empty token list (every sequence needs >= 1 new token)")
    # JAX: prompts padded to a bucket -- but not on a sharded decoder, whose messages would grow
    # with the padding (the ledger counts the bytes really sent; decoding pads nothing anyway)
    bucketed = getattr(cache, "bucketed", False) and decoder.whole
    ids, pos, valid, lens = pack(token_lists, cache.lengths[slots], decoder.block_size, bucketed)
    step = CacheStep(cache, slots, pos, valid)
    with no_grad():
        h = decoder.embed(ids, positions=pos) if x is None else Tensor(x)
        for layer, block in enumerate(decoder.blocks):
            h = block(h, cache=step.layer(layer))
        out = h if decoder.head is None else decoder.head(h)
    cache.lengths[slots] += lens
    return out.data


def last_logits(logits, token_lists):
    """The logits after each sequence's last real token: (B, V)."""
    lens = np.array([len(t) for t in token_lists]) - 1
    return logits[np.arange(len(token_lists)), lens]
