"""Exercise 9: the KV cache of decoding -- one cached attention step, then a paged block table.

Generating token t attends to the keys and values of tokens 0..t. Recomputing them all every step
costs O(T²); a KV cache keeps them, so each step computes only the new token's q, k, v. A paged
cache (vLLM) stores them in fixed-size blocks from a shared pool, found through a per-sequence
block table, so no sequence reserves memory for tokens it never generates.

Estimated time: 1 h (attention step 20 min, gather 15 min, append 25 min)
Points: cached_attention_step 3, paged_gather 2, paged_append 3.
Grade it:  python -m minidist.grade kv_cache
The grader decodes random sequences step by step against full causal attention written out, and
interleaves appends of several sequences into one pool. Lesson: lessons/09-inference.md; minidist's
caches are minidist/infer/kv_cache.py and paged.py.
"""

import numpy as np  # noqa: F401  (you will need it)


def cached_attention_step(q, k_new, v_new, cache_k, cache_v, pos):
    """Attention output (H, D) of the token at position ``pos``, using and filling the cache.

    q, k_new, v_new (H, D): the new token's query, key, value for each of H heads. cache_k, cache_v
    (H, T_max, D) hold the keys and values of positions 0..pos-1; write k_new, v_new at ``pos`` (in
    place), then for each head: softmax over positions 0..pos (the new token included, nothing
    beyond) of q·k / sqrt(D), weighted sum of the values.
    Does not modify q, k_new or v_new (only the caches).
    """
    raise NotImplementedError


def paged_gather(pool, block_table, length, block_size):
    """The first ``length`` cached vectors of one sequence, contiguous: (length, D).

    pool (n_blocks, block_size, D) is shared by all sequences; ``block_table[i]`` is the pool block
    holding the sequence's positions i*block_size .. (i+1)*block_size - 1.
    Does not modify its inputs.
    """
    raise NotImplementedError


def paged_append(pool, block_table, free_blocks, length, kv, block_size):
    """Append one vector ``kv`` (D,) to a sequence that holds ``length`` of them; return length + 1.

    When the sequence's blocks are full (length is a multiple of block_size) take a block from the
    END of the list ``free_blocks`` (``free_blocks.pop()``) and append it to ``block_table``; then
    write kv at its position. Both lists are modified in place; never take a block otherwise.
    Does not modify kv (only pool and the two lists).
    """
    raise NotImplementedError
