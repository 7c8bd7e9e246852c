"""Lesson 9, part 3: prefix caching of a shared system prompt, and the KV cache's bytes per token.

``prefix_caching``: hit rate, prefill tokens saved and time to first token with and without;
``kv_memory``: bytes per token beside 2·L·K·(d/H)·bytes, grouped-query attention and int8 shrinking it
(and int8's accuracy: each cached vector within 1/254 of its largest value, the logits within 1%).
"""

from __future__ import annotations

import math

import numpy as np

from minidist.accel.backend import to_host
from minidist.infer import (
    GREEDY,
    Decoder,
    Int8KVCache,
    KVCache,
    Request,
    forward_tokens,
    int8_bytes_per_token,
    serve,
)
from minidist.infer.quant_kv import dequantize, quantize
from minidist.lessons.inference_kv import PROMPTS, enc

SYSTEM = "You are minidist's tutor: answer briefly. "


def prefix_caching(model, args):
    """A shared system prompt, a request arriving every 2 steps: later requests find its blocks."""
    bl, new = 8, 8
    head = enc(SYSTEM)[:max(0, args.block - max(len(enc(q)) for q in PROMPTS) - new)]
    reqs = [Request(i, head + enc(PROMPTS[i % len(PROMPTS)]), new, GREEDY, arrival=2 * i) for i in range(12)]
    res, ttft = {}, {}
    for _ in range(3):  # best of 3 medians, taken in turn
        for name, kw in (("without", {"cache": "paged"}), ("with", {"prefix_cache": True})):
            res[name] = serve(model, reqs, max_batch=args.batch, block_len=bl, **kw)
            med = float(np.median([r.ttft_s for r in res[name][2]]))
            ttft[name] = min(ttft.get(name, math.inf), med)
    st = res["with"][1]
    print(f"\n3b. prefix caching: {len(reqs)} requests share a {len(head)}-token system prompt "
          f"(one arrives every 2 steps, blocks of {bl}, {args.batch} slots)")
    print(f"   hit rate {st['hit_rate']:.0%} of {st['looked_up_tokens']} prompt tokens; prefill tokens saved "
          f"{st['prefill_tokens_saved']} (>= (n-1)·{len(head) // bl}·{bl}: the system prompt's whole "
          f"blocks; a repeated question shares more)")
    print(f"   tokens through the model: {res['without'][1]['forward_rows']} without, "
          f"{st['forward_rows']} with")
    print(f"   time to first token (median, best of 3): {1e3 * ttft['without']:.2f} ms without, "
          f"{1e3 * ttft['with']:.2f} ms with")
    saved = st["prefill_tokens_saved"] >= (len(reqs) - 1) * (len(head) // bl) * bl
    ok = res["with"][0] == res["without"][0] and saved
    print(f"   serial twin: the same tokens with and without sharing, saved >= formula {saved}: "
          f"{'PASS' if ok else 'FAIL'}")
    return ok


def quantizer_error(arrays) -> float:
    """The largest |x̂ - x| / max|x| of any vector (last axis) of ``arrays`` stored as int8 and read
    back (``quant_kv``'s rule: at most 1/254)."""
    worst = 0.0
    for x in arrays:
        q, scale = quantize(x)
        err, top = np.abs(dequantize(q, scale, x.dtype) - x).max(-1), np.abs(x).max(-1)
        worst = max(worst, float(np.max(err / np.where(top > 0, top, 1.0))))
    return worst


def kv_memory(model, args, reqs, contiguous_out):
    """Bytes per cached token from the arrays beside the formulas; int8: tokens and logit error."""
    dec, L, H, K = Decoder.from_model(model), args.layers, args.heads, args.kv_heads
    hd = args.d_model // H
    measured = KVCache.for_decoder(dec, 1).bytes_per_token()
    mha = KVCache(L, 1, H, hd, 1).bytes_per_token()
    print(f"\n3c. KV cache bytes per token: {H} query heads, K = {K} K/V heads (--kv-heads), head_dim {hd}")
    print(f"   multi-head 2·L·H·(d/H)·4 = {2 * L * H * hd * 4:,} (measured {mha:,}); this model "
          f"2·L·K·(d/H)·4 = {2 * L * K * hd * 4:,} (measured {measured:,}): H/K = {H // K}x smaller")
    ok = measured == 2 * L * K * hd * 4 and mha == 2 * L * H * hd * 4
    if args.kv_dtype == "int8":
        q = Int8KVCache.for_decoder(dec, args.batch)
        want = int8_bytes_per_token(L, K, hd)
        out, _, _ = serve(model, reqs, max_batch=args.batch, cache=q)
        same = sum(out[i] == contiguous_out[i] for i in out)
        seq = enc(PROMPTS[0]) + contiguous_out[0]
        caches = KVCache.for_decoder(dec, 1), Int8KVCache.for_decoder(dec, 1)
        a, b = (to_host(forward_tokens(dec, c, [0], [seq]))[0] for c in caches)
        err, top = float(np.abs(a - b).max()), float(np.abs(a).max())
        vec = quantizer_error([to_host(x)[:, :, :len(seq)] for x in (*caches[0].k, *caches[0].v)])
        print(f"   int8 (--kv-dtype int8): 2·L·K·(d/H + 4) = {want:,} bytes (measured "
              f"{q.bytes_per_token():,}): {measured / want:.2f}x smaller than float32")
        print(f"   greedy tokens: {same} of {len(out)} requests identical to the float32 cache"
              + ("" if same == len(out) else " (int8 rounding changed a close argmax: reported, not hidden)"))
        ratio = f"1/{1 / vec:.1f}" if vec else "0"
        print(f"   each cached vector: max |x̂ - x| / max |x| = {ratio} <= 1/254 (the quantizer's bound, over "
              f"the sequence's {2 * L * K * len(seq)} vectors)")
        print(f"   max |logits diff| over a {len(seq)}-token sequence {err:.1e} = {err / top:.2%} of max "
              f"|logit| (bound 1% = {0.01 * top:.1e})")
        ok &= q.bytes_per_token() == want and err <= 0.01 * top and vec <= (1 + 1e-5) / 254
    print(f"   measured == formula: {'PASS' if ok else 'FAIL'}")
    return ok
