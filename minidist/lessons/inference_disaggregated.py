"""Lesson 9, part 6: prefill and decode on separate ranks, beside every rank doing both.

A mixed workload served disaggregated (the KV cache sent from prefill to decode ranks, bytes
beside ``kv_message_bytes``) and colocated; the same tokens either way.
"""

from __future__ import annotations

from minidist.comm import measure
from minidist.infer import Request
from minidist.infer.colocated import colocated_serve
from minidist.infer.disaggregated import disaggregated_serve, kv_message_bytes
from minidist.lessons.cli import (
    rprint,
)
from minidist.lessons.inference_kv import PROMPTS, enc


def mixed_workload(args, n=16):
    """Every 4th request a long prompt (most of the context), the rest short; 12 tokens each,
    arriving 2 ms apart."""
    long_text = enc(" ".join(PROMPTS))[:args.block - 13]
    reqs = [Request(i, long_text if i % 4 == 0 else enc(PROMPTS[i % len(PROMPTS)]), 12) for i in range(n)]
    return reqs, [0.002 * i for i in range(n)]


def disaggregation(comm, model, args):
    if args.disaggregate is None:
        rprint(comm, "\n6. disaggregated serving: needs >= 2 ranks (--disaggregate P:D)")
        return True
    p, d = args.disaggregate
    reqs, arrivals = mixed_workload(args)
    colo = colocated_serve(comm, model, reqs, arrivals, max_batch=args.batch)
    with measure(comm) as m:
        dis = disaggregated_serve(comm, model, reqs, arrivals, prefill_ranks=p, max_batch=args.batch)
    sent = comm.gather_obj(m.bytes_sent, root=0)
    if comm.rank != 0:
        return True
    lens = sorted({len(r.prompt) for r in reqs})
    print(f"\n6. disaggregated serving: {len(reqs)} requests (prompts of {lens[0]}-{lens[-1]} tokens, every "
          f"4th long; 12 new tokens each, arriving 2 ms apart), {comm.size} ranks")
    print(f"   {'':28s}{'TTFT p50':>10s}{'p90':>9s}{'TPOT p50':>10s}{'p90':>9s}   (ms)")
    for name, sv in ((f"colocated ({comm.size} x both)", colo), (f"disaggregated ({p} : {d})", dis)):
        ms = {key: 1e3 * v for key, v in sv.summary().items()}
        print(f"   {name:28s}{ms['ttft_p50']:10.1f}{ms['ttft_p90']:9.1f}{ms['tpot_p50']:10.2f}"
              f"{ms['tpot_p90']:9.2f}")
    want = [sum(kv_message_bytes(model.config, len(r.prompt)) * args.kv_heads // args.heads
                for i, r in enumerate(reqs) if i % p == rank) if rank < p else 0 for rank in range(comm.size)]
    print(f"   KV caches sent per rank: {', '.join(f'{b:,}' for b in sent)}")
    print(f"   formula sum 2·L·T·K·(d/H)·4 over each prefill rank's prompts: "
          f"{', '.join(f'{b:,}' for b in want)}")
    ok = dis.outputs == colo.outputs and sent == want
    print(f"   serial twin: disaggregated == colocated token for token, bytes == formula: "
          f"{'PASS' if ok else 'FAIL'}")
    return ok
