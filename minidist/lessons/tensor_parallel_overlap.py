"""Lesson 4 with ``--overlap`` on the virtual clock: when collective matmul beats the unfused layer.

One sequence-parallel column-parallel layer (forward, tp = 2) runs both ways while the link is
swept from fast to slow. With p ranks, one hop of a sequence shard taking h = alpha + S/beta:

    unfused            T_u(h)  = (p-1)·h + C            the all-gather, then one GEMM
    collective matmul  T_cm(h) = (p-1)·max(c, h) + c    p chunks, each hiding the next hop

C is the whole GEMM, c one chunk. Where the hop hides (h <= c) collective matmul wins once
(p-1)·h > p·c - C: at h* = (p·c - C)/(p-1), the extra the p chunks cost, shared by the p-1 hops
they hide -- a launch overhead per chunk, and on a memory-bound device the weight shard read p
times instead of once (chapter 4). C and p·c are the clock's times at a free link; the sweep then
checks both lines and the crossover, and the trace's hidden share against min(1, c/h).
"""

from __future__ import annotations

import math

import numpy as np

from minidist import trace
from minidist.autograd.tensor import Tensor, no_grad
from minidist.comm.transports.link import Link
from minidist.lessons.allreduce_model import measured_crossover, virtual_seconds
from minidist.parallel.tensor.collective_matmul import hidden_share, use_collective_matmul
from minidist.parallel.tensor.layers import ColumnParallelLinear

TOLERANCE = 0.05  # the crossover, interpolated between two swept links, and the clock vs the lines
SHAPE = (4, 256, 512, 2048)  # batch, sequence, input features, output features (2048/tp each rank)


def layer_time(group, layer, x, link: Link, cm: bool, tracer=None) -> float:
    """Virtual seconds of one forward of ``layer`` on ``link``, collective matmul on or off."""
    group.clock.link = link
    use_collective_matmul(layer, cm)
    with no_grad(), trace.tracing(tracer):
        layer(x)  # first call: private channels, buffers
        return virtual_seconds(group, lambda: layer(x))


def cm_crossover(comm, link: Link) -> bool:
    """The sweep on ranks 0 and 1 (the others wait); rank 0 prints. Returns the verdict, which
    counts only under a device model (CPU time moves the crossover with this machine's noise)."""
    group = comm.split(0 if comm.rank < 2 else None, comm.rank)
    if group is None or group.size < 2:
        return True
    b, s, k, n = SHAPE
    p, saved = group.size, group.clock.link
    layer = ColumnParallelLinear(k, n, group, bias=False, sequence_parallel=True,
                                 rng=np.random.default_rng(0))
    x = Tensor(np.random.default_rng(1).standard_normal((b, s // p, k)).astype(np.float32))
    shard = x.data.nbytes
    free = Link(0.0, math.inf)
    C, pc = layer_time(group, layer, x, free, False), layer_time(group, layer, x, free, True)
    c, h_star = pc / p, (pc - C) / (p - 1)
    hops = [max(h_star, c / 8) * 2 ** (i / 2) for i in range(-4, 5)]  # around h*: a quarter to 4x
    rows = [(h, layer_time(group, layer, x, Link(0.0, shard / h), False),
             layer_time(group, layer, x, Link(0.0, shard / h), True)) for h in hops]
    tracer = trace.Tracer(group.rank)
    at_link = layer_time(group, layer, x, link, True, tracer)
    h_link = link.alpha + shard / link.bandwidth
    group.clock.link = saved
    if group.rank != 0:
        return True
    device = group.clock.device is not None
    seen = measured_crossover(hops, [u for _, u, _ in rows], [m for _, _, m in rows])
    fits = all(abs(u - (C + (p - 1) * h)) <= TOLERANCE * u and
               abs(m - ((p - 1) * max(c, h) + c)) <= TOLERANCE * m for h, u, m in rows)
    found = h_star > 0 and seen is not None and abs(seen - h_star) <= TOLERANCE * h_star
    share, want = hidden_share(tracer.events), min(1.0, c / h_link)
    agree = abs(share - want) <= 0.01 and abs(at_link - ((p - 1) * max(c, h_link) + c)) <= TOLERANCE * at_link
    print(f"\ncollective matmul vs the unfused layer, on the virtual clock: one column-parallel layer "
          f"forward, tp = {p},\n  x {b}x{s}x{k} -> {n // p} features a rank, S = {shard:,} B a shard, "
          "compute " + (f"on {group.clock.device.name}" if device else "in CPU time"))
    print(f"  at a free link: C = {C * 1e6:.2f} us (the whole GEMM), p·c = {pc * 1e6:.2f} us (the {p} "
          f"chunks); h* = (p·c - C)/(p-1) = {h_star * 1e6:.3f} us,\n  so collective matmul wins on a link "
          "slower than " + (f"S/h* = {shard / h_star / 1e9:,.0f} GB/s" if h_star > 0 else "any (p·c <= C)"))
    print(f"  {'link GB/s':>10} {'hop us':>8} {'unfused: (p-1)h + C / clock':>29} "
          f"{'cm: (p-1)max(c,h) + c / clock':>31}  faster")
    for h, u, m in rows:
        cm_line = (p - 1) * max(c, h) + c
        print(f"  {shard / h / 1e9:>10.4g} {h * 1e6:>8.3f} {(C + (p - 1) * h) * 1e6:>18.2f} / "
              f"{u * 1e6:<8.2f} {cm_line * 1e6:>20.2f} / {m * 1e6:<8.2f}  {'cm' if m < u else 'unfused'}")
    verdict = ("PASS" if fits and found else "FAIL") if device else "(no verdict: compute in CPU time)"
    print(f"  the clock's lines cross at h = {seen * 1e6:.3f} us" if seen else
          "  the clock's lines never cross", f"(h* = {h_star * 1e6:.3f} us)  {verdict}")
    print(f"  on this lesson's link ({link}): a hop takes {h_link * 1e6:.2f} us, c = {c * 1e6:.2f} us; "
          f"the trace shows {share:.0%} of the hops' time\n  hidden behind GEMM chunks, min(1, c/h) = "
          f"{want:.0%}  " + ("PASS" if agree else "FAIL" if device else "(no verdict)"))
    return (fits and found and agree) or not device
