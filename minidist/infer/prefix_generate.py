"""``generate`` over a paged cache, each prompt first looking up its cached prefix.

The serving loop the tests compare token by token with plain ``generate``: prompt i prefills in
slot i only what ``PrefixCachingKVCache.match`` did not find cached, so later prompts hit the
blocks of earlier ones; decoding is batched. Over a plain ``PagedKVCache`` nothing is shared.
"""

from __future__ import annotations

import numpy as np

from minidist.infer.decoder import as_decoder, forward_tokens, last_logits
from minidist.infer.generate import check_prompts, decode_loop, host
from minidist.infer.paged import PagedKVCache
from minidist.infer.sampling import GREEDY
from minidist.trace.spans import now


def generate_with_prefix_cache(model, prompts, max_new_tokens: int, cache: PagedKVCache,
                               sampling=GREEDY, stop_tokens=(), return_logits: bool = False, ids=None,
                               ttft: list | None = None):
    """``generate`` over a paged ``cache`` (slots 0..len(prompts)-1, released at the end): each
    prompt in turn looks up its cached prefix and prefills the rest, so later prompts also hit the
    earlier ones' blocks; decoding is batched. With a plain ``PagedKVCache`` nothing is shared.

    ``ttft``: a list to which each prompt's time to first token is appended (seconds from the
    call to its first token's logits), for a benchmark to set with and without sharing."""
    t0 = now()
    dec = as_decoder(model)
    prompts = check_prompts(prompts, dec.block_size, dec.vocab_size, max_new_tokens)
    if len(prompts) > cache.n_slots:
        raise ValueError(f"generate_with_prefix_cache: {len(prompts)} prompts for a cache of "
                         f"{cache.n_slots} slots; pass at most {cache.n_slots} per call")
    busy = [i for i in range(len(prompts)) if cache.n_blocks[i] or cache.lengths[i]]
    if busy:
        raise ValueError(f"generate_with_prefix_cache: slots {busy} of the cache are in use; it serves "
                         f"from slots 0..{len(prompts) - 1}, which must be released")
    held = [list(p) for p in prompts]  # the tokens each slot holds after this step
    sharing = hasattr(cache, "match")

    def feed_slot(i, toks):
        cache.reserve(i, int(cache.lengths[i]) + len(toks))
        logits = forward_tokens(dec, cache, [i], [toks])
        if sharing:
            cache.commit(i, held[i])
        out = host(last_logits(logits, [toks]))[0]
        if ttft is not None:
            ttft.append(now() - t0)
        return out

    def step(active, feed):
        if all(int(cache.lengths[i]) == 0 for i in active):  # prefill, one prompt at a time
            return np.stack([feed_slot(i, held[i][cache.match(i, held[i]) if sharing else 0:])
                             for i in active])
        for i, toks in zip(active, feed):
            held[i] += toks
            cache.reserve(i, len(held[i]))
        logits = host(last_logits(forward_tokens(dec, cache, active, feed), feed))
        if sharing:
            for i in active:
                cache.commit(i, held[i])
        return logits

    try:
        return decode_loop(step, prompts, max_new_tokens, sampling, stop_tokens, return_logits,
                           vocab_size=dec.vocab_size, ids=ids)
    finally:
        for i in range(len(prompts)):
            cache.release(i)
