"""Generation: prefill the prompts in one pass, then decode one token at a time from the KV cache.

    generate(model, prompts, max_new_tokens)            # KV-cached, batched, ragged prompts
    generate_recompute(model, prompts, max_new_tokens)  # the serial twin (recompute.py)

A sequence that finishes (a stop token, or its ``max_new_tokens``) leaves the batch while the
others go on; ``decode_loop`` is the loop every generator shares.
"""

from __future__ import annotations

import numpy as np

from minidist.accel.backend import backend_of
from minidist.autograd.tensor import no_grad
from minidist.infer.decoder import as_decoder, forward_tokens, last_logits
from minidist.infer.kv_cache import KVCache
from minidist.infer.sampling import GREEDY, SamplingParams, is_int, sample


def check_prompt(prompt, block_size: int, max_new_tokens: int = 0, what: str = "prompt",
                 vocab_size: int | None = None) -> list:
    """A prompt as a list of ints; a clear error, naming ``what``, if it is empty, holds something
    other than token ids in [0, vocab_size), or can't fit the context with ``max_new_tokens``."""
    if not (is_int(max_new_tokens) and max_new_tokens >= 0):
        raise ValueError(f"{what}: max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    arr = np.asarray(prompt)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what} must hold integer token ids, got dtype {arr.dtype}")
    toks = [int(t) for t in arr.reshape(-1)]
    if not toks:
        raise ValueError(f"{what} is empty: generation needs at least one token to start from")
    if len(toks) > block_size:
        raise ValueError(f"{what} has {len(toks)} tokens, longer than the context (block_size {block_size})")
    bad = [(j, t) for j, t in enumerate(toks) if vocab_size is not None and not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{what} has token id {bad[0][1]} at position {bad[0][0]} ({len(bad)} out of range "
                         f"in all): token ids must be in [0, {vocab_size}) for vocab_size {vocab_size}")
    if len(toks) + max_new_tokens > block_size:
        raise ValueError(f"{what}: {len(toks)} tokens + max_new_tokens {max_new_tokens} = "
                         f"{len(toks) + max_new_tokens} > block_size {block_size}; ask for at most "
                         f"{block_size - len(toks)} new tokens")
    return toks


def check_prompts(prompts, block_size: int, vocab_size: int, max_new_tokens: int, who: str = "") -> list:
    """A batch of prompts checked by ``check_prompt`` (``who``: a prefix such as "rank 3: ");
    a clear error for an empty batch, which has nothing to generate from."""
    prompts = list(prompts) if hasattr(prompts, "__iter__") else []
    if not prompts:
        raise ValueError(f"{who}no prompts: pass a list of at least one prompt, each a list of token ids "
                         f"(e.g. [[1, 2, 3]])")
    return [check_prompt(p, block_size, max_new_tokens, f"{who}prompt {i}", vocab_size)
            for i, p in enumerate(prompts)]


def check_ids(ids, n: int, who: str = "", taken=()) -> list:
    """n request ids (None: 0..n-1), each seeding a sampling stream: distinct ints >= 0, none in ``taken``."""
    ids = list(range(n)) if ids is None else list(ids)
    bad = [i for i in ids if not (is_int(i) and i >= 0)]
    if len(ids) != n or bad:
        raise ValueError(f"{who}request ids must be integers >= 0 (each seeds a sampling stream), one per "
                         f"request: {n} requests, {len(ids)} ids{f', bad ids {bad}' if bad else ''}")
    if len(set(ids)) < n or any(i in taken for i in ids):
        dup = next(i for i in ids if ids.count(i) > 1 or i in taken)
        raise ValueError(f"{who}request id {dup} is given twice: ids must be unique (two requests would "
                         "share one sampling stream and one answer would be lost)")
    return ids


def stop_set(stop: object) -> set:
    """Stop tokens as a set of ints: None for none, one token id, or any iterable of them."""
    toks = list(stop) if hasattr(stop, "__iter__") else [] if stop is None else [stop]
    if not all(is_int(t) for t in toks):
        raise ValueError(f"stop_tokens must be token ids (integers), one id, or None, got {stop!r}")
    return {int(t) for t in toks}


def host(a) -> np.ndarray:
    return backend_of(a).to_host(a)


def is_done(out: list, max_new_tokens: int, stop_tokens) -> bool:
    return len(out) >= max_new_tokens or (bool(out) and out[-1] in stop_tokens)


def decode_loop(step, prompts, max_new_tokens, sampling=GREEDY, stop_tokens=(), return_logits=False,
                agree=None, vocab_size=0, ids=None):
    """Prefill all prompts, then decode until every sequence is done; the loop every generator shares.

    ``step(active, feed)`` runs one forward pass for sequences ``active`` fed ``feed`` (token lists)
    and returns their last logits (B, V) on the host -- or None on a rank that holds no logits
    (an early pipeline stage). ``agree(tokens or None) -> tokens`` makes every rank use the
    tokens sampled where the logits are (sharded serving); serially it is not needed.
    ``ids``: each sequence's generator stream (default 0, 1, ...)."""
    stop, ids = stop_set(stop_tokens), check_ids(ids, len(prompts))
    outs, logs, rngs = [[] for _ in prompts], [[] for _ in prompts], [sampling.generator(i) for i in ids]
    active, feed = list(range(len(prompts))), prompts  # prefill: every prompt in one pass
    with no_grad():
        while active and max_new_tokens > 0:
            logits = step(active, feed)
            toks = None if logits is None else sample(logits, sampling, [rngs[i] for i in active],
                                                      [ids[i] for i in active], len(outs[active[0]]))
            toks = toks if agree is None else agree(toks)
            for row, (i, tok) in enumerate(zip(active, toks)):
                outs[i].append(tok)
                if return_logits and logits is not None:
                    logs[i].append(logits[row])
            active = [i for i in active if not is_done(outs[i], max_new_tokens, stop)]
            feed = [[outs[i][-1]] for i in active]  # decode: one token each
    if return_logits:
        return outs, [np.stack(lg) if lg else np.zeros((0, vocab_size)) for lg in logs]
    return outs


def generate(model, prompts, max_new_tokens: int, sampling: SamplingParams = GREEDY, stop_tokens=(),
             return_logits: bool = False, ids=None):
    """New tokens for each prompt (a list per prompt; a stop token is included and ends it).

    Sequence i samples with ``sampling.generator(stream=ids[i])`` (default ``ids = 0, 1, ...``).
    ``return_logits``: also return, per sequence, the (n_new, V) logits each token was drawn from.
    """
    dec = as_decoder(model)
    prompts = check_prompts(prompts, dec.block_size, dec.vocab_size, max_new_tokens)
    cache = KVCache.for_decoder(dec, len(prompts), max(len(p) for p in prompts) + max_new_tokens)

    def step(active, feed):
        return host(last_logits(forward_tokens(dec, cache, active, feed), feed))

    return decode_loop(step, prompts, max_new_tokens, sampling, stop_tokens, return_logits,
                       vocab_size=dec.vocab_size, ids=ids)
