"""Inference: KV-cached, batched, continuously batched, paged and sharded generation.

* decoder.py   -- ``Decoder`` (the layers a rank serves with), ``forward_tokens``: prefill/decode
* kv_cache.py  -- ``KVCache``: contiguous, preallocated per layer and slot; ``CacheStep``: a model's view
* paged.py     -- ``PagedKVCache``: fixed-size blocks, block tables, a free list, ``OutOfBlocks``
* sampling.py  -- ``SamplingParams``: greedy, temperature, top-k, top-p, seeded per sequence
* generate.py  -- ``generate`` (cached, batched) and its serial twin ``generate_recompute``
* scheduler.py -- ``Scheduler``/``serve``: continuous (or static) batching with a request queue
* sharded.py   -- ``sharded_generate``: tensor-parallel and pipelined generation over a communicator
* speculative.py -- ``speculative_generate``: a draft model proposes k tokens, the target verifies them
"""

from minidist.infer.decoder import Decoder, as_decoder, forward_tokens, last_logits
from minidist.infer.generate import full_logits, generate, generate_recompute
from minidist.infer.kv_cache import CacheStep, KVCache, causal_mask
from minidist.infer.paged import OutOfBlocks, PagedKVCache
from minidist.infer.sampling import GREEDY, SamplingParams, filter_probs, sample
from minidist.infer.scheduler import Request, Scheduler, serve
from minidist.infer.sharded import shard_for, sharded_generate, tp_block
from minidist.infer.speculative import SpecStats, early_exit_draft, expected_speedup, speculative_generate

__all__ = [
    "GREEDY", "CacheStep", "Decoder", "KVCache", "OutOfBlocks", "PagedKVCache", "Request", "SamplingParams",
    "Scheduler", "SpecStats", "as_decoder", "causal_mask", "early_exit_draft", "expected_speedup",
    "filter_probs", "forward_tokens", "full_logits", "generate", "generate_recompute", "last_logits",
    "sample", "serve", "shard_for", "sharded_generate", "speculative_generate", "tp_block",
]
