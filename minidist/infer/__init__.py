"""Inference: KV-cached, batched, continuously batched, paged and sharded generation.

* decoder.py   -- ``GPTWeights`` (a GPT's arrays) and ``forward_tokens``: prefill/decode over a cache
* kv_cache.py  -- ``KVCache``: contiguous, preallocated per layer and slot
* paged.py     -- ``PagedKVCache``: fixed-size blocks, block tables, a free list, ``OutOfBlocks``
* sampling.py  -- ``SamplingParams``: greedy, temperature, top-k, top-p, seeded per sequence
* generate.py  -- ``generate`` (cached, batched) and its serial twin ``generate_recompute``
* scheduler.py -- ``Scheduler``/``serve``: continuous (or static) batching with a request queue
* sharded.py   -- ``sharded_generate``: tensor-parallel and pipelined generation over a communicator
"""

from minidist.infer.decoder import GPTWeights, attention, causal_mask, forward_tokens, last_logits
from minidist.infer.generate import full_logits, generate, generate_recompute
from minidist.infer.kv_cache import KVCache
from minidist.infer.paged import OutOfBlocks, PagedKVCache
from minidist.infer.sampling import GREEDY, SamplingParams, filter_probs, sample
from minidist.infer.scheduler import Request, Scheduler, serve
from minidist.infer.sharded import sharded_generate, tp_shard

__all__ = [
    "GREEDY", "GPTWeights", "KVCache", "OutOfBlocks", "PagedKVCache", "Request", "SamplingParams",
    "Scheduler", "attention", "causal_mask", "filter_probs", "forward_tokens", "full_logits", "generate",
    "generate_recompute", "last_logits", "sample", "serve", "sharded_generate", "tp_shard",
]
