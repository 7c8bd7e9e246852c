"""The serial twin of ``generate``: no cache, the training-time forward over the whole sequence for
every new token, one sequence at a time -- O(T²) work, and what the KV cache must agree with."""

from __future__ import annotations

import numpy as np

from minidist.autograd.tensor import no_grad
from minidist.infer.buckets import bucket, compiles_per_shape
from minidist.infer.generate import check_ids, check_prompt, host, is_done, stop_set
from minidist.infer.sampling import GREEDY, SamplingParams, sample


def full_logits(model, tokens) -> np.ndarray:
    """Logits (T, V) of the training-time forward over ``tokens``: no cache, the reference. On JAX
    the tokens are padded to the next power of two (one program per bucket, not per length); causal
    attention keeps the padding out of the real positions."""
    n = len(tokens)
    if compiles_per_shape(next(iter(model.parameters())).backend):
        tokens = list(tokens) + [0] * (bucket(n, model.config.block_size) - n)
    with no_grad():
        return host(model(np.asarray([tokens], dtype=np.int64)).data)[0, :n]


def generate_recompute(model, prompts, max_new_tokens: int, sampling: SamplingParams = GREEDY,
                       stop_tokens=(), return_logits: bool = False, ids=None):
    """The serial twin of ``generate``: every new token re-runs ``model`` over the whole sequence."""
    cfg = model.config
    prompts = list(prompts)
    stop, outs, logs, ids = stop_set(stop_tokens), [], [], check_ids(ids, len(prompts))
    for i, p in enumerate(prompts):
        seq = check_prompt(p, cfg.block_size, max_new_tokens, f"prompt {i}", cfg.vocab_size)
        rng, out, lg = sampling.generator(ids[i]), [], []
        while max_new_tokens > 0 and not is_done(out, max_new_tokens, stop):
            logits = full_logits(model, seq + out)[-1]
            out.append(sample(logits[None], sampling, [rng], [ids[i]], len(out))[0])
            lg.append(logits)
        outs.append(out)
        logs.append(np.stack(lg) if lg else np.zeros((0, cfg.vocab_size)))
    return (outs, logs) if return_logits else outs
