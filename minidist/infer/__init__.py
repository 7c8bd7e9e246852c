"""Inference: KV-cached, batched, continuously batched, paged, prefix-cached and sharded generation.

* decoder.py       -- ``Decoder`` (the layers a rank serves with), ``forward_tokens``: prefill/decode
* kv_cache.py      -- ``KVCache``: contiguous, preallocated per layer and slot; ``CacheStep``: a model's view
* paged.py         -- ``PagedKVCache``: fixed-size blocks, block tables, a free list, ``OutOfBlocks``
* prefix_cache.py  -- ``PrefixCachingKVCache``: full blocks shared by hash of their prefix, LRU eviction;
                      prefix_generate.py: ``generate_with_prefix_cache``, generation over it
* quant_kv.py      -- ``Int8KVCache``, ``Int8PagedKVCache``, ``Int8PrefixCachingKVCache``: int8 K/V
* buckets.py       -- power-of-two shapes for JAX (few compiled programs)
* sampling.py      -- ``SamplingParams``: greedy, temperature, top-k, top-p, seeded per sequence
* generate.py      -- ``generate`` (cached, batched); recompute.py: its serial twin ``generate_recompute``
* scheduler.py     -- ``Scheduler``/``serve``: continuous (or static) batching with a request queue,
                      on a contiguous, paged or prefix-caching cache
* sharded.py       -- ``sharded_generate``: tensor-parallel and pipelined generation over a communicator
* speculative.py   -- ``speculative_generate``: a draft model proposes k tokens, the target verifies them;
                      drafts.py: ``early_exit_draft``, a draft made of the target's first layers
* disaggregated.py -- ``disaggregated_serve``: prefill ranks send prompts' K/V to decode ranks;
                      colocated.py: ``colocated_serve``, the baseline where every rank does both
* router.py        -- ``route``: requests spread over scheduler replicas (round robin, least loaded)
"""

from minidist.infer.colocated import colocated_serve
from minidist.infer.decoder import Decoder, as_decoder, forward_tokens, last_logits
from minidist.infer.disaggregated import disaggregated_serve
from minidist.infer.drafts import early_exit_draft
from minidist.infer.generate import generate
from minidist.infer.kv_cache import CacheStep, KVCache, causal_mask
from minidist.infer.paged import OutOfBlocks, PagedKVCache
from minidist.infer.prefix_cache import PrefixCachingKVCache
from minidist.infer.prefix_generate import generate_with_prefix_cache
from minidist.infer.quant_kv import (
    Int8KVCache,
    Int8PagedKVCache,
    Int8PrefixCachingKVCache,
    int8_bytes_per_token,
)
from minidist.infer.recompute import full_logits, generate_recompute
from minidist.infer.router import route
from minidist.infer.sampling import GREEDY, SamplingParams, filter_probs, sample
from minidist.infer.scheduler import Request, Scheduler, serve
from minidist.infer.sharded import shard_for, sharded_generate, tp_block
from minidist.infer.speculative import SpecStats, expected_speedup, speculative_generate

__all__ = [
    "GREEDY", "CacheStep", "Decoder", "Int8KVCache", "Int8PagedKVCache", "Int8PrefixCachingKVCache",
    "KVCache", "OutOfBlocks", "PagedKVCache", "PrefixCachingKVCache", "Request", "SamplingParams",
    "Scheduler", "SpecStats",
    "as_decoder", "causal_mask", "colocated_serve", "disaggregated_serve", "early_exit_draft",
    "expected_speedup", "filter_probs", "forward_tokens", "full_logits", "generate", "generate_recompute",
    "generate_with_prefix_cache", "int8_bytes_per_token", "last_logits", "route", "sample", "serve",
    "shard_for", "sharded_generate", "speculative_generate", "tp_block",
]
