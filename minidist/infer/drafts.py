"""Drafts for speculative decoding that need no training: the target's own first layers.

A self-speculative draft (Zhang et al. 2023, LayerSkip) is a ``GPT`` of the target's first
``n_layer`` blocks with its embedding and head: the same vocabulary, nothing to train, and how often
it agrees with the whole model is what ``speculative_generate``'s acceptance rate measures.
"""

from __future__ import annotations

import numpy as np

from minidist.nn.gpt import GPT


def early_exit_draft(target, n_layer: int):
    """A ``GPT`` of ``target``'s first ``n_layer`` blocks, with its embedding and head (eval mode)."""
    cfg = target.config
    if isinstance(n_layer, bool) or not isinstance(n_layer, (int, np.integer)) \
            or not 1 <= n_layer <= cfg.n_layer:
        raise ValueError(f"early_exit_draft: n_layer must be an integer in 1..{cfg.n_layer} (the target's "
                         f"layers), got {n_layer!r}")
    draft = GPT(cfg.replace(n_layer=n_layer))
    state = {}
    for key, value in target.state_dict().items():  # layer i of GPT's list: embed 0, blocks, head last
        i, rest = key.split(".", 1)
        if int(i) <= n_layer:
            state[key] = value
        elif int(i) == cfg.n_layer + 1:
            state[f"{n_layer + 1}.{rest}"] = value
    draft.load_state_dict(state)
    return draft.eval()
