"""The inference forward pass: a GPT's weights as raw arrays, run over a KV cache.

Training builds a graph; serving doesn't need one. Here the GPT's pieces (``Embed``'s wte/wpe,
each ``Block``'s ln1 / attn.qkv / attn.proj / ln2 / mlp, the ``Head``) are taken as plain arrays
(``GPTWeights.from_model``) and run with the very same op forwards the engine uses
(``ops.LayerNorm.forward`` ...) under a context that saves nothing -- no Tensors, no graph.

One call, ``forward_tokens(weights, cache, slots, token_lists)``, covers every case:

* prefill   -- a whole prompt per sequence, keys/values written into the cache;
* decode    -- one new token per sequence, attending to everything cached so far;
* mixed     -- some sequences prefilling while others decode (continuous batching);
* chunked   -- a prompt fed in pieces (any split point gives the same logits).

Each sequence has its own position: sequence b's tokens sit at positions
``cache.lengths[slot_b] + t``. Rows are padded to the longest; ``causal_mask`` hides per
sequence (key j is visible to a query at position p iff j <= p), so different lengths never mix.
The same functions serve tensor parallelism (``BlockWeights.reduce`` all-reduces the
row-parallel products) and pipeline stages (``GPTWeights.embed``/``head`` say which ends this
rank holds): sharded.py only slices weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from minidist import ops
from minidist.backend import backend_of


class _NoRecord:
    """A stand-in for the autograd Context: op forwards may save and set attributes; all is dropped."""

    needs_grad = (False, False, False, False)

    def save(self, *arrays):
        pass


def layer_norm(x, wbe):
    w, b, eps = wbe
    return ops.LayerNorm.forward(_NoRecord(), x, w, b, eps)


def linear(x, w, b=None):
    return ops.Linear.forward(_NoRecord(), x, w, b)


def gelu(x):
    return ops.Gelu.forward(_NoRecord(), x)


def softmax(x):
    return ops.Softmax.forward(_NoRecord(), x, -1)


@dataclass
class BlockWeights:
    """One transformer block's arrays. Under tensor parallelism these are this rank's slices."""

    ln1: tuple  # (weight, bias, eps)
    qkv_w: object  # (d, 3·H·D): columns [q heads | k heads | v heads]
    qkv_b: object
    proj_w: object  # (H·D, d)
    proj_b: object
    ln2: tuple
    fc_w: object  # (d, hidden)
    fc_b: object
    mlp_w: object  # (hidden, d)
    mlp_b: object
    n_head: int  # heads held here
    reduce: object = None  # called on row-parallel partial sums (TP all-reduce); None = serial


@dataclass
class GPTWeights:
    """The arrays of a GPT (or of one pipeline stage of it: ``embed``/``head`` say which ends)."""

    blocks: list
    block_size: int
    vocab_size: int
    wte: object = None
    wpe: object = None
    ln_f: tuple | None = None
    head_w: object = None

    @property
    def embed(self) -> bool:
        return self.wte is not None

    @property
    def head(self) -> bool:
        return self.head_w is not None

    @property
    def dtype(self):
        return self.blocks[0].qkv_w.dtype if self.blocks else (self.wte if self.embed else self.head_w).dtype

    @classmethod
    def from_model(cls, model) -> GPTWeights:
        """Views (no copies) of ``minidist.nn.GPT``'s parameters: Embed, Blocks, Head."""
        cfg = model.config
        emb, head = model[0], model[len(model) - 1]
        blocks = []
        for i in range(1, cfg.n_layer + 1):
            blk = model[i]
            blocks.append(BlockWeights(
                ln1=(blk.ln1.weight.data, blk.ln1.bias.data, blk.ln1.eps),
                qkv_w=blk.attn.qkv.weight.data, qkv_b=blk.attn.qkv.bias.data,
                proj_w=blk.attn.proj.weight.data, proj_b=blk.attn.proj.bias.data,
                ln2=(blk.ln2.weight.data, blk.ln2.bias.data, blk.ln2.eps),
                fc_w=blk.mlp.fc.weight.data, fc_b=blk.mlp.fc.bias.data,
                mlp_w=blk.mlp.proj.weight.data, mlp_b=blk.mlp.proj.bias.data,
                n_head=blk.attn.n_head))
        return cls(blocks=blocks, block_size=cfg.block_size, vocab_size=cfg.vocab_size,
                   wte=emb.wte.weight.data, wpe=emb.wpe.weight.data,
                   ln_f=(head.ln.weight.data, head.ln.bias.data, head.ln.eps), head_w=head.proj.weight.data)


def row_parallel(x, w, b, reduce):
    """``x @ w + b`` where ``w`` may hold only some rows: partial sums are all-reduced before the bias."""
    if reduce is None:
        return linear(x, w, b)
    return reduce(x @ w) + b


def causal_mask(xp, qpos, tk: int):
    """Which keys each query may not see: (B, 1, Tq, Tk), True where key j > qpos[b, i] -- or None
    when nothing is hidden (a batch that only decodes, each query at the newest cached key).

    qpos (B, Tq) is the position of each query and key j sits at position j, so each sequence has
    its own length and a batch of different lengths needs no shared offset. Built once per forward
    (``run_blocks``) and shared by every layer.
    """
    if qpos.shape[-1] == 1 and int(qpos.min()) >= tk - 1:
        return None
    return (xp.arange(tk)[None, None, :] > xp.asarray(qpos)[:, :, None])[:, None]


def attention(q, k, v, hidden=None):
    """softmax(q·kᵀ/√D, masked)·v, inference only: q (B, H, Tq, D); k, v (B, H, Tk, D); ``hidden``
    from ``causal_mask`` (None: every key visible)."""
    xp = backend_of(q).xp
    s = (q @ xp.swapaxes(k, -1, -2)) * q.dtype.type(1.0 / math.sqrt(q.shape[-1]))
    if hidden is not None:
        s = xp.where(hidden, xp.asarray(-xp.inf, dtype=s.dtype), s)
    return softmax(s) @ v


def pack(token_lists, starts, block_size):
    """Pad ragged token lists into arrays: ids (B, T), positions (B, T), valid (B, T), lengths (B,)."""
    lens = np.array([len(t) for t in token_lists], dtype=np.int64)
    b, t = len(token_lists), int(lens.max())
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


def embed(weights: GPTWeights, ids, pos):
    """Token + position embedding, each sequence at its own positions."""
    be = backend_of(weights.wte)
    return weights.wte[be.from_host(ids)] + weights.wpe[be.from_host(pos)]


def run_blocks(weights: GPTWeights, cache, slots, x, pos, valid):
    """Every block of ``weights`` on hidden states x (B, T, C), reading and writing ``cache``."""
    b, t, _ = x.shape
    tk = int(pos[valid].max()) + 1  # keys needed: up to the furthest real query
    rows = cache.index(slots)
    hidden = causal_mask(backend_of(x).xp, pos, tk)
    for layer, w in enumerate(weights.blocks):
        h = linear(layer_norm(x, w.ln1), w.qkv_w, w.qkv_b)  # (B, T, 3·H·D)
        d = h.shape[-1] // (3 * w.n_head)
        q, k, v = h.reshape(b, t, 3, w.n_head, d).transpose(2, 0, 3, 1, 4)
        cache.write(layer, slots, pos, valid, k, v)
        kk, vv = cache.read(layer, rows, tk)
        y = attention(q, kk, vv, hidden).transpose(0, 2, 1, 3).reshape(b, t, w.n_head * d)
        x = x + row_parallel(y, w.proj_w, w.proj_b, w.reduce)
        m = gelu(linear(layer_norm(x, w.ln2), w.fc_w, w.fc_b))
        x = x + row_parallel(m, w.mlp_w, w.mlp_b, w.reduce)
    return x


def head(weights: GPTWeights, x):
    return layer_norm(x, weights.ln_f) @ weights.head_w


def forward_tokens(weights: GPTWeights, cache, slots, token_lists, x=None):
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
    ids, pos, valid, lens = pack(token_lists, cache.lengths[slots], weights.block_size)
    if x is None:
        x = embed(weights, ids, pos)
    x = run_blocks(weights, cache, slots, x, pos, valid)
    cache.lengths[slots] += lens
    return head(weights, x) if weights.head else x


def last_logits(logits, token_lists):
    """The logits after each sequence's last real token: (B, V)."""
    lens = np.array([len(t) for t in token_lists]) - 1
    return logits[np.arange(len(token_lists)), lens]
