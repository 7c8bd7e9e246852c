"""An MoE GPT: every block's MLP a mixture of experts, serial or expert parallel.

``moe_gpt(model, n_experts, k, ...)`` turns a GPT (or TPGPT) into one in place, every layout drawing
the same weights; ``expert_names`` maps an expert-parallel model's local parameter names to the
serial model's (what a checkpoint and the serial twin compare by).
"""

from __future__ import annotations

import math

import numpy as np

from minidist.nn.module import Module
from minidist.nn.moe import MoE
from minidist.parallel.experts.dispatch import ExpertParallelMoE


def replace_child(parent: Module, name: str, new: Module) -> None:
    """Swap child ``name`` keeping its place in the parameter order (setattr would move it last)."""
    parent._modules[name] = new
    object.__setattr__(parent, name, new)


def moe_gpt(model, n_experts: int, k: int = 1, capacity_factor: float | None = None, seed: int = 0,
            ep=None):
    """Replace the MLP of every block of ``model`` (GPT or TPGPT) by an MoE of ``n_experts``, in place.

    Every layout draws the same weights (``seed``; experts std 0.02, output projection scaled by
    1/sqrt(2·n_layer) as the GPT's). ``ep``: the expert-parallel group (None: all experts here).
    ``capacity_factor`` None is E/k: every expert has room for every token, nothing is dropped, and
    the routing does not depend on how tokens are grouped -- what lets a run over any mesh equal its
    serial twin. (With drops, routing groups are each rank's microbatches: see ``ExpertParallelMoE``.)
    """
    rng = np.random.default_rng(seed)
    blocks = [m for m in model if hasattr(m, "mlp") and hasattr(m, "ln2")]
    cf = capacity_factor or n_experts / k
    for block in blocks:
        dim, dtype = block.ln2.weight.shape[0], block.ln2.weight.data.dtype
        kw = dict(dtype=dtype, std=0.02, proj_std=0.02 / math.sqrt(2 * len(blocks)), rng=rng,
                  backend=block.ln2.weight.backend)
        if ep is None:
            replace_child(block, "mlp", MoE(dim, n_experts, k, cf, **kw))
        else:
            replace_child(block, "mlp", ExpertParallelMoE(dim, n_experts, ep, k, cf, **kw))
    return model


def expert_names(layers) -> dict:
    """{local parameter name: the serial model's name} of every expert-parallel parameter in
    ``layers`` ((prefix, module) pairs, e.g. a pipeline stage's ("3.", layer))."""
    names = {}
    for prefix, layer in layers:
        for mprefix, mod in layer.named_modules(prefix):
            if isinstance(mod, ExpertParallelMoE):
                for pname, _ in mod.experts.named_parameters("experts."):
                    names[mprefix + pname] = mprefix + mod.global_name(pname)
    return names
