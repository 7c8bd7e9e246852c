"""Activation recomputation: keep a function's inputs, recompute its insides during backward.

``recompute(fn, *inputs)`` is one node in the autograd graph (the ``Function`` ``Recompute``). Its
forward runs ``fn`` under ``no_grad`` -- nothing inside is saved -- and keeps only the inputs and the
random state; its backward sets that random state again (dropout draws the same masks), re-runs
``fn`` with gradients on and back-propagates through the recomputed graph. Parameters inside ``fn``
are leaves of that inner graph, so their post-accumulate hooks (DDP's all-reduces) still fire layer
by layer (Chen et al. 2016; PyTorch's reentrant ``torch.utils.checkpoint``).

``apply_recompute(model, policy)`` wraps a GPT's blocks (serial or tensor-parallel) by a policy:
"none", "full", "every_k", "sqrt" or "selective" (only the attention core). In a pipeline each
stage recomputes its own layers (``recompute_stage``); ``check_segments_within`` refuses a segment
that crosses a stage boundary. The policies by number are ``recompute_policy.py`` (re-exported).
Chapter 6 (lessons/06-checkpointing.md) derives the memory each policy keeps.
"""

from __future__ import annotations

import numpy as np

from minidist.autograd import ops
from minidist.autograd import random as mrandom
from minidist.autograd.modes import recomputing, recomputing_depth
from minidist.autograd.tensor import Function, Tensor, enable_grad, grad_enabled, no_grad, run_backward
from minidist.nn.module import Module, Sequential
from minidist.parallel.memory.recompute_policy import (
    POLICIES,
    block_activation_elements,
    predicted_peak_activation_bytes,
    segment_size,
)

__all__ = ["POLICIES", "POSITION", "Recompute", "apply_recompute", "block_activation_elements",
           "block_generators", "check_segments_within", "is_block", "predicted_peak_activation_bytes",
           "recompute", "recompute_stage", "recomputing_depth", "remove_recompute", "segment_size"]

#: where the policies' forward wrappers sit in ``Module``'s stack (``nn.module.WRAPPER_ORDER``: outside
#: ZeRO-3's gather and autocast, so a recomputation gathers and casts again)
POSITION = "recompute"

class Recompute(Function):
    """The node: forward without a graph, backward = restore RNG, recompute, backprop."""

    composite = True  # its work is the ops it runs (a device model prices those, not the node)

    @staticmethod
    def forward(ctx, *arrays, fn, generators):
        ctx.fn, ctx.generators = fn, generators
        ctx.rng_state = mrandom.get_state()
        ctx.gen_states = [g.bit_generator.state for g in generators]
        ctx.save(*arrays)
        with no_grad():
            out = fn(*[Tensor(a) for a in arrays])
        if not isinstance(out, Tensor):
            raise TypeError(f"recompute: fn must return one Tensor, got {type(out).__name__}")
        return out.data

    @staticmethod
    def backward(ctx, grad):
        leaves = [Tensor(a, requires_grad=need) for a, need in zip(ctx.saved, ctx.needs_grad)]
        now = mrandom.get_state()
        now_gens = [g.bit_generator.state for g in ctx.generators]
        mrandom.set_state(ctx.rng_state)
        for g, st in zip(ctx.generators, ctx.gen_states):
            g.bit_generator.state = st
        try:
            with recomputing(), enable_grad():
                out = ctx.fn(*leaves)
        finally:
            mrandom.set_state(now)
            for g, st in zip(ctx.generators, now_gens):
                g.bit_generator.state = st
        if out.requires_grad:
            run_backward(out, grad)
        return tuple(leaf.grad if need else None for leaf, need in zip(leaves, ctx.needs_grad))


def recompute(fn, *inputs, generators=()):
    """``fn(*inputs)`` with only ``inputs`` kept for backward; ``fn`` is recomputed in backward.

    ``inputs`` are Tensors (or arrays); ``fn`` returns one Tensor. Random draws inside ``fn`` come
    from ``minidist.autograd.random``'s default generator (and from ``generators``, e.g. a tensor-parallel
    RNG), whose states are saved and replayed, so the recomputation is bit-identical.
    """
    if not grad_enabled():
        return fn(*inputs)
    tensors = [t if isinstance(t, Tensor) else Tensor(t) for t in inputs]
    if not any(t.requires_grad for t in tensors):
        # No input wants a gradient, but parameters inside fn do: give the node one input that
        # does (an empty array) so it is recorded and its backward runs.
        anchor = Tensor(tensors[0].backend.xp.zeros(0, dtype=np.float32) if tensors
                        else np.zeros(0, dtype=np.float32), requires_grad=True)
        return Recompute.apply(*tensors, anchor, fn=lambda *ts: fn(*ts[:-1]), generators=tuple(generators))
    return Recompute.apply(*tensors, fn=fn, generators=tuple(generators))


# ---------------------------------------------------------------------------------------------
# policies for a GPT (Embed, Block x n, Head) -- serial or tensor-parallel
# ---------------------------------------------------------------------------------------------
def is_block(module) -> bool:
    """A transformer block, what policies recompute: a Module with an attention (``attn``) and an
    MLP (``mlp``) -- ``nn.gpt.Block`` or the tensor-parallel ``ParallelBlock``, recognised by shape so
    recomputation depends on neither."""
    parts = (getattr(module, "attn", None), getattr(module, "mlp", None))
    return isinstance(module, Module) and all(isinstance(p, Module) for p in parts)


def _blocks(model):
    return [(i, m) for i, m in enumerate(model) if is_block(m)]


def block_generators(module) -> tuple:
    """Random generators a (tensor-parallel) block draws from besides the default one: the
    ``ShardedRNG`` generators of its sequence-parallel dropouts (``dropout_rng="megatron"``).
    ``Recompute`` saves and replays their states too, so recomputed masks are the same."""
    gens = {}
    for _, m in module.named_modules():
        rng = getattr(m, "sharded_rng", None)
        if rng is not None:
            gens[id(rng.generator)] = rng.generator
    return tuple(gens.values())


def _selective_attention_forward(attn, x):
    """The attention forward (serial ``CausalSelfAttention`` or ``ParallelAttention``, whose rank holds
    ``local_heads``) with its core recomputed (the T x T probabilities): the same fused
    ``packed_attention`` as without recomputation, so the extra cost is that op's forward, once."""
    heads = getattr(attn, "local_heads", attn.n_head)
    return attn.drop(attn.proj(recompute(lambda qkv: ops.packed_attention(qkv, heads), attn.qkv(x))))


def apply_recompute(model, policy: str = "full", k: int | None = None):
    """Recompute a GPT's blocks (serial ``Block`` or tensor-parallel ``ParallelBlock``) by ``policy``
    (see ``POLICIES``); returns the model.

    Works on any Sequential whose layers include blocks; segments never cross a non-block layer.
    For a pipeline, recompute each stage's own layers (``recompute_stage`` on each chunk, as
    ``parallelize`` does): a segment of the whole model may span a stage boundary, and
    ``check_segments_within`` refuses such a model. Each block (for "selective": each block's
    attention) gets a forward wrapper at the ``POSITION`` of ``Module``'s wrapper stack, outside
    ZeRO-3's gather and autocast, so a recomputation gathers and casts again; ``remove_recompute``
    (or applying another policy) removes exactly those wrappers. A model with no block raises.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown recompute policy {policy!r}; choose one of {', '.join(POLICIES)}")
    remove_recompute(model)
    blocks = _blocks(model)
    if policy == "none":
        return model
    if not blocks:
        raise ValueError(f"apply_recompute({policy!r}): {type(model).__name__} has no transformer block "
                         "(nn.gpt.Block or the tensor-parallel ParallelBlock) among its layers, so nothing "
                         "would be recomputed; pass a GPT, a TPGPT or a Sequential of their blocks")
    owner = f"activation recomputation ({policy})"
    if policy == "selective":
        grouped = [b for _, b in blocks if getattr(b.attn, "n_kv_head", b.attn.n_head) != b.attn.n_head]
        if grouped:
            raise ValueError("recompute policy 'selective' recomputes multi-head attention's core; with "
                             f"grouped-query attention (n_kv_head={grouped[0].attn.n_kv_head} < n_head="
                             f"{grouped[0].attn.n_head}) it is not built: use 'full'")
        for _, blk in blocks:
            blk.attn.register_forward_wrapper(_selective_wrapper, POSITION, owner)
        return model
    size = segment_size(policy, len(blocks), k)
    runs, cur = [], []  # runs of consecutive blocks, cut into segments of `size`
    for i, blk in blocks:
        if cur and (cur[-1][0] != i - 1 or len(cur) == size):
            runs.append(cur)
            cur = []
        cur.append((i, blk))
    runs.append(cur)
    for seg in runs:
        layers = tuple(b for _, b in seg)
        gens = tuple({id(g): g for b in layers for g in block_generators(b)}.values())
        layers[0].register_forward_wrapper(_segment_wrapper(layers, gens), POSITION, owner)
        for b in layers[1:]:  # computed inside the first member's segment
            b.register_forward_wrapper(_skip, POSITION, owner)
        for b in layers:  # every member knows its segment: check_segments_within checks none is cut
            object.__setattr__(b, "_recompute_segment", layers)
    return model


def _segment_wrapper(layers, generators):
    """The first member's wrapper: one ``recompute`` node running every member's inner stack
    (ZeRO-3 gather, autocast, the block), recomputed as a whole in backward."""
    def run(x):
        for b in layers:
            x = b.call_inside(POSITION, x)
        return x

    def wrapper(module, inner, x, **kwargs):
        if _inference(kwargs):
            return inner(x, **kwargs)
        return recompute(run, x, generators=generators)
    return wrapper


def _skip(module, inner, x, **kwargs):
    """A later segment member: already computed by the first member's recomputed segment."""
    if _inference(kwargs):
        return inner(x, **kwargs)
    return x


def _selective_wrapper(attn, inner, x, **kwargs):
    """The attention with only its core recomputed. It computes the attention itself (the core is
    inside its forward), so it does not call ``inner``: nothing else wraps an attention module."""
    if _inference(kwargs):
        return inner(x, **kwargs)
    return _selective_attention_forward(attn, x)


def _inference(kwargs) -> bool:
    """No graph is recorded, or a KV cache is passed: nothing to keep, the layers run as they are."""
    return not grad_enabled() or any(v is not None for v in kwargs.values())


def recompute_stage(layers, policy: str, k: int | None = None):
    """Recompute the blocks among one pipeline stage's ``layers`` (a list), so segments stay inside
    the stage ("sqrt" is then sqrt of the stage's block count). A stage without blocks (embedding
    or head only) is left as it is. Returns a ``Sequential`` of the layers (for
    ``remove_recompute``)."""
    seq = Sequential(layers)
    return apply_recompute(seq, policy, k) if _blocks(seq) else seq


def check_segments_within(layers, layer_ids, stage: int) -> None:
    """Raise if a recomputed segment among ``layers`` (one stage's, full-model indices ``layer_ids``)
    also holds blocks outside them: its recomputation would run another stage's blocks on this
    stage's copies, and their owning stage would get no gradient."""
    mine = {id(m) for m in layers}
    for i, m in zip(layer_ids, layers):
        seg = m.__dict__.get("_recompute_segment", ())
        if any(id(b) not in mine for b in seg):
            raise ValueError(
                f"pipeline stage {stage}: layer {i} is in a recomputed segment of {len(seg)} blocks that "
                f"crosses this stage's boundary (layers {layer_ids[0]}..{layer_ids[-1]}); apply "
                "recomputation per stage instead: parallelize(..., checkpoint=policy) on a model without it "
                "(or recompute_stage(chunk, policy) on each of the stage's chunks), or the 'full' / "
                "'selective' policy, whose segments are single blocks")


def remove_recompute(model):
    """Undo ``apply_recompute``: the ``POSITION`` wrappers of every block of ``model`` (and of
    its attention) are removed and the blocks forget their segment. Other wrappers (ZeRO-3's,
    autocast's) stay."""
    for _, blk in _blocks(model):
        for m in (blk, blk.attn):
            handle = m.forward_wrapper(POSITION)
            if handle is not None:
                handle.remove()
        blk.__dict__.pop("_recompute_segment", None)
    return model


# the names before the word "checkpoint" was kept for saved state (issue 39): still importable
Checkpoint = Recompute
checkpoint = recompute
apply_checkpointing = apply_recompute
remove_checkpointing = remove_recompute
checkpoint_stage = recompute_stage
