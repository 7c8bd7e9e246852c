"""Lesson 3, section 3: per-rank memory and traffic of plain DP and ZeRO-1/2/3 beside their formulas.

One step of each (the second: the optimizer state exists): parameters, gradients and AdamW state
from the memory accountant beside (P+G+K)Ψ, (P+G)Ψ+KΨ/N, PΨ+(G+K)Ψ/N, (P+G+K)Ψ/N, and the bytes
sent (ledger) beside 2(N-1)/N·Ψ and 3(N-1)/N·Ψ.
"""

from __future__ import annotations

import numpy as np

from minidist.comm import measure
from minidist.comm.cost import all_reduce_bytes_sent
from minidist.nn import GPT, optim
from minidist.nn.footprint import MemoryAccountant, zero_formula
from minidist.parallel.data.ddp import DDP
from minidist.parallel.data.zero import ZeRO, param_count


def stage_numbers(comm, args, cfg, batches, stage):
    """One step of DP (stage 0) or ZeRO-``stage``: (memory report, bytes sent by collectives, Ψ)."""
    m = GPT(cfg)
    acct = MemoryAccountant()
    x, y = batches[0]
    if stage == 0:
        wrapper = DDP(m, comm, bucket_bytes=args.bucket_kb * 1024)
        opt = optim.AdamW(m.parameters(), lr=args.lr)
    else:
        wrapper = ZeRO(m, comm, lambda ps: optim.AdamW(ps, lr=args.lr), stage=stage,
                       bucket_bytes=args.bucket_kb * 1024)
        opt = wrapper
    for _ in range(2):  # the second step: the optimizer state exists
        with measure(comm) as meas:
            with acct.track_activations(m):
                loss = m.loss(x, y)
            wrapper.backward(loss)
            wrapper.wait_gradients()
            rep = acct.report(m, opt)
            if stage == 0:
                opt.step()
                opt.zero_grad()
            else:
                wrapper.update()
    names = ("ring_all_reduce", "reduce_scatter", "all_gather")  # not the tiny loss all-reduce
    sent = sum(c.bytes_sent for c in meas.calls if c.name in names)
    return rep, sent, param_count(m)


def show_memory(comm, args, cfg, batches) -> None:
    """Section 3 for the GPT ``cfg``: every rank runs the steps; rank 0 prints the table."""
    p = comm.size
    rows = []
    for stage in (0, 1, 2, 3):
        rows.append(stage_numbers(comm, args, cfg, batches, stage))
    if comm.rank == 0:
        psi = rows[0][2]
        item = np.dtype(args.dtype).itemsize
        print(f"3. Per-rank memory and traffic, Ψ = {psi:,} parameters, N = {p}, {args.dtype} params and "
              f"grads, AdamW m+v in {args.dtype}  (MB = 1e6 bytes, rank 0)")
        print("   stage   params  (formula)   grads  (formula)  opt state (formula)   sent/rank  (formula)")
        names = ["DP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
        for stage, (rep, sent, _) in enumerate(rows):
            f = zero_formula(stage, psi, p, item, item, 2 * item)
            k = 3 if stage == 3 else 2
            fs = k / 2 * all_reduce_bytes_sent("ring", psi * item, p, comm.rank)  # ZeRO-3: 1.5x DP
            print(f"   {names[stage]:7s} {rep['params'] / 1e6:6.3f} ({f['params'] / 1e6:6.3f})  "
                  f"{rep['grads'] / 1e6:6.3f} ({f['grads'] / 1e6:6.3f})  {rep['optimizer_state'] / 1e6:7.3f} "
                  f"({f['optimizer_state'] / 1e6:6.3f})   {sent / 1e6:7.3f}  "
                  f"({fs / 1e6:6.3f} = {k}(N-1)/N·Ψ·{item}B)")
        print("   formulas (B = bytes/element): DP (P+G+K)Ψ; ZeRO-1 (P+G)Ψ+KΨ/N; ZeRO-2 PΨ+(G+K)Ψ/N; "
              "ZeRO-3 (P+G+K)Ψ/N;\n   paper, fp16 + fp32 Adam: 16Ψ; 4Ψ+12Ψ/N; 2Ψ+14Ψ/N; 16Ψ/N. "
              "ZeRO-3 sends 3Ψ less one gather of the embeddings: their backward needs no weights.")
        peak = rows[1][0]["activations_peak"]
        print(f"   activations saved for backward (peak, rank 0): {peak / 1e6:.3f} MB")
