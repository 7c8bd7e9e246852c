"""A context-parallel GPT: each rank feeds its own tokens, attention spans the ``cp`` group.

``context_parallel(model, cp)`` turns a GPT (or a TPGPT: heads over tp, sequence over cp) into its
context-parallel self in place: the embedding adds each token's *global* position, every attention
layer becomes :func:`~minidist.parallel.context.ring.packed_ring_attention` (``mode="ring"``: K/V
round a ring) or :func:`~minidist.parallel.context.ulysses.packed_ulysses_attention`
(``mode="ulysses"``: two all-to-alls swap the split to the heads and back), every other layer is
unchanged (they work token by token). Each rank feeds ``shard_sequence(idx, cp.rank, cp.size)``.
"""

from __future__ import annotations

import numpy as np

from minidist.nn.module import Module
from minidist.parallel.context.layout import chunk_ids, chunk_positions
from minidist.parallel.context.ring import AttentionStats, packed_ring_attention
from minidist.parallel.context.ulysses import check_heads, packed_ulysses_attention
from minidist.parallel.context.usp import packed_usp_attention, usp_groups

MODES = ("ring", "ulysses", "hybrid")


class ContextParallelAttention(Module):
    """An attention layer (serial or tensor-parallel: its heads) whose attention spans ``cp``:
    ring (``mode="ring"``) or Ulysses (``mode="ulysses"``)."""

    def __init__(self, attn, cp, layout="zigzag", mode="ring", groups=None):
        super().__init__()
        self.qkv, self.proj, self.drop = attn.qkv, attn.proj, attn.drop
        object.__setattr__(self, "heads", getattr(attn, "local_heads", attn.n_head))
        object.__setattr__(self, "cp", cp)
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "stats", AttentionStats())
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "groups", groups)  # hybrid: (Ulysses group, ring across groups)

    def forward(self, x, cache=None):
        if cache is not None:
            raise ValueError(f"rank {self.cp.rank}: context parallelism is for training; decode without it")
        if self.mode == "ulysses":
            y = packed_ulysses_attention(self.qkv(x), self.heads, self.cp, self.layout)
        elif self.mode == "hybrid":
            y = packed_usp_attention(self.qkv(x), self.heads, self.groups, self.layout)
        else:
            y = packed_ring_attention(self.qkv(x), self.heads, self.cp, self.layout, stats=self.stats)
        return self.drop(self.proj(y))


class ContextParallelEmbed(Module):
    """Token + position embedding of this rank's tokens: their positions are the global ones."""

    def __init__(self, embed, cp, layout="zigzag"):
        super().__init__()
        self.wte, self.wpe, self.drop = embed.wte, embed.wpe, embed.drop
        object.__setattr__(self, "cp", cp)
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "block_size", embed.block_size)

    def forward(self, idx, start: int = 0):
        idx = idx.data if hasattr(idx, "data") and not isinstance(idx, np.ndarray) else idx
        t_total = idx.shape[1] * self.cp.size
        if start or t_total > self.block_size:
            raise ValueError(f"rank {self.cp.rank}: a context-parallel sequence starts at 0 and is at most "
                             f"block_size={self.block_size} long; got start={start}, length {t_total}")
        pos = chunk_positions(t_total, self.cp.size, self.cp.rank, self.layout)
        return self.drop(self.wte(idx) + self.wpe(pos))  # host positions, as ``minidist.nn.gpt.Embed``


def replace_child(parent: Module, name: str, new: Module) -> None:
    """Swap child ``name`` keeping its place in the parameter order (setattr would move it last)."""
    parent._modules[name] = new
    object.__setattr__(parent, name, new)


def context_parallel(model, cp, layout: str = "zigzag", mode: str = "ring", ulysses_size: int | None = None):
    """Make ``model`` (a GPT or TPGPT: Embed, Blocks, Head) context parallel over ``cp``, in place.

    Each rank then feeds ``shard_sequence(idx, cp.rank, cp.size, layout)`` and its loss is the mean
    over its own tokens; parameter names and values are unchanged. Dropout would draw masks no
    serial model draws, so it is refused; ``mode="ulysses"`` needs cp to divide the (local) heads;
    ``mode="hybrid"``: Ulysses inside groups of ``ulysses_size`` ranks (dividing cp and the heads),
    a ring across the groups."""
    chunk_ids(cp.rank, cp.size, layout)
    if mode not in MODES:
        raise ValueError(f"rank {cp.rank}: context_parallel mode={mode!r}; use one of {MODES}")
    cfg = getattr(model, "config", None)
    if cfg is not None and cfg.dropout:
        raise ValueError(f"rank {cp.rank}: context parallelism with dropout={cfg.dropout} is not built "
                         "(its masks would differ from the serial model's); use dropout=0")
    if getattr(model, "sequence_parallel", False):
        raise ValueError(f"rank {cp.rank}: context parallelism over a sequence-parallel TPGPT is not built; "
                         "build the TPGPT with sequence_parallel=False")
    if cfg is not None and cfg.kv_heads != cfg.n_head:
        raise ValueError(f"rank {cp.rank}: context parallelism with grouped-query attention (n_kv_head="
                         f"{cfg.kv_heads} < n_head={cfg.n_head}) is not built: the ring and Ulysses attend "
                         "packed q|k|v of n_head heads each; use n_kv_head=n_head")
    blocks = list(model)[1:-1]
    u = cp.size if mode == "ulysses" else ulysses_size
    if mode == "hybrid" and ulysses_size is None:
        raise ValueError(f"rank {cp.rank}: mode='hybrid' needs ulysses_size= (ranks per Ulysses group)")
    if mode in ("ulysses", "hybrid"):
        for block in blocks:
            check_heads(getattr(block.attn, "local_heads", block.attn.n_head), u, cp.rank)
    groups = usp_groups(cp, u) if mode == "hybrid" else None
    replace_child(model, "0", ContextParallelEmbed(model[0], cp, layout))
    for block in blocks:
        replace_child(block, "attn", ContextParallelAttention(block.attn, cp, layout, mode, groups))
    return model


def attention_stats(model) -> AttentionStats:
    """The sum of every ring-attention layer's counters in ``model``."""
    total = AttentionStats()
    for _, m in model.named_modules():
        if isinstance(m, ContextParallelAttention):
            for f in ("pairs", "forward_flops", "backward_flops"):
                setattr(total, f, getattr(total, f) + getattr(m.stats, f))
    return total
