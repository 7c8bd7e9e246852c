"""All-reduces in log2 p rounds: recursive doubling (latency-optimal), two-shot (the ring's bytes in
2 rounds) and halving-doubling (Rabenseifner: the ring's bytes in 2 log2 p steps). For p not a power
of two the extra ranks fold into a partner first and get the result back last (``_fold_in`` /
``_fold_out``). Bytes and steps: the table in ``collectives.py``.
"""

from __future__ import annotations

import numpy as np

from minidist.comm.call import OPS, collective, scratch
from minidist.comm.ring import split_sizes

# -- recursive doubling (latency optimal: log2 p steps, any p) ------------------------------------

def recursive_doubling_all_reduce(comm, x, op: str = "sum"):
    """Partners at distance 1, 2, 4, ... swap whole arrays and combine: log2 p steps.

    For p not a power of two, the first 2*rem ranks (rem = p - 2**floor(log2 p)) pair up first:
    even ranks hand their array to the odd neighbour and sit out, getting the result at the end.
    """
    with collective(comm, "recursive_doubling_all_reduce", x, op=op) as k:
        c, buf = k.comm, k.flat.copy()
        r, p, fn = c.rank, c.size, OPS[op]
        pof2 = 1 << (p.bit_length() - 1)
        rem, tmp, rounds = p - pof2, scratch(c, buf.size, buf.dtype), pof2.bit_length() - 1
        vrank = _fold_in(k, buf, tmp, fn, rem)
        if vrank >= 0:
            mask = 1
            while mask < pof2:
                peer = _real_rank(vrank ^ mask, rem)
                c.sendrecv_buffer(buf, peer, tmp, peer, k.tag)
                fn(tmp, buf, out=buf) if peer < r else fn(buf, tmp, out=buf)  # lower rank first
                mask <<= 1
        _fold_out(k, buf, rem)
        k.step(rounds + (2 if rem else 0))  # rounds of the algorithm (idle ones included)
        return k.result(buf)


# -- two-shot: the ring's bytes in 2 rounds ------------------------------------------------------

def two_shot_all_reduce(comm, x, op: str = "sum"):
    """Reduce-scatter, then all-gather, each in ONE round of p-1 messages in flight at once.

    Round 1: rank r sends chunk j of its x to rank j (for every j != r) and receives chunk r from
    everyone, then reduces them in rank order. Round 2: it sends its reduced chunk to everyone and
    receives theirs. Bytes as the ring, 2(p-1)/p·N, in 2 rounds instead of 2(p-1) steps: no rank
    waits for a neighbour that waits for its own -- what costs most when ranks outnumber cores.
    The price is p-1 messages per round instead of one.
    """
    with collective(comm, "two_shot_all_reduce", x, op=op) as k:
        c, src = k.comm, k.flat
        p, r, fn = c.size, c.rank, OPS[op]
        bounds = np.cumsum([0] + split_sizes(src.size, p))
        part = [slice(bounds[j], bounds[j + 1]) for j in range(p)]
        out = np.empty_like(src)
        n = bounds[r + 1] - bounds[r]
        incoming = scratch(c, p * n, src.dtype).reshape(p, n)
        peers = [j for j in range(p) if j != r]
        reqs = [c.irecv_buffer(incoming[j], j, k.tag) for j in peers]
        reqs += [c.isend_buffer(src[part[j]], j, k.tag) for j in peers]
        c.wait_all(reqs, "two-shot reduce-scatter")
        incoming[r] = src[part[r]]
        out[part[r]] = incoming[0]
        for j in range(1, p):                    # in rank order: every rank's chunk adds up alike
            fn(out[part[r]], incoming[j], out=out[part[r]])
        k.finish(out[part[r]])
        reqs = [c.irecv_buffer(out[part[j]], j, k.tag + 1) for j in peers]   # round 2: phase bit
        reqs += [c.isend_buffer(out[part[r]], j, k.tag + 1) for j in peers]
        c.wait_all(reqs, "two-shot all-gather")
        k.step(2 if p > 1 else 0)           # p = 1: nothing to exchange, no rounds
        return k.be.from_host(out.reshape(np.shape(x)))


# -- halving-doubling (Rabenseifner): the ring's bytes in 2 log2 p steps ---------------------------

def halving_doubling_all_reduce(comm, x, op: str = "sum"):
    """Reduce-scatter by recursive halving, then all-gather by recursive doubling.

    Step k of the first half: swap half of the part you still own with the partner 2**k away
    (farthest first) and reduce the half you keep; after log2 p steps you own one chunk, fully
    reduced. The second half retraces the steps, doubling what you own. Bytes as the ring,
    2(p-1)/p N for p a power of two, but in 2 log2 p steps instead of 2(p-1): better when latency
    (or a crowded CPU) dominates. Other p: the extra ranks fold in first, as in recursive doubling.
    """
    with collective(comm, "halving_doubling_all_reduce", x, op=op) as k:
        c, src = k.comm, k.flat
        p, fn = c.size, OPS[op]
        q = 1 << (p.bit_length() - 1)
        rem, logq = p - q, q.bit_length() - 1
        buf, tmp = np.empty_like(src), scratch(c, src.size, src.dtype)
        if c.rank < 2 * rem or q == 1:           # folding works in place: start from a copy
            buf[...] = src
            src = buf
        vrank = _fold_in(k, buf, tmp, fn, rem)

        if vrank >= 0:
            bounds = np.cumsum([0] + split_sizes(buf.size, q))
            lo, hi, mask = 0, q, q >> 1
            while mask:                          # reduce-scatter: halve what I own each step
                mid, peer = (lo + hi) // 2, _real_rank(vrank ^ mask, rem)
                low = not vrank & mask           # the lower partner keeps the lower half
                (klo, khi), (slo, shi) = ((lo, mid), (mid, hi)) if low else ((mid, hi), (lo, mid))
                keep, incoming = slice(bounds[klo], bounds[khi]), tmp[:bounds[khi] - bounds[klo]]
                c.sendrecv_buffer(src[bounds[slo]:bounds[shi]], peer, incoming, peer, k.tag)
                fn(src[keep], incoming, out=buf[keep])  # the first step reads the input: no copy of it
                lo, hi, mask, src = klo, khi, mask >> 1, buf
            mask = 1
            while mask < q:                      # all-gather: double what I own each step
                width, peer = hi - lo, _real_rank(vrank ^ mask, rem)
                plo, phi = (hi, hi + width) if not vrank & mask else (lo - width, lo)
                c.sendrecv_buffer(buf[bounds[lo]:bounds[hi]], peer, buf[bounds[plo]:bounds[phi]], peer, k.tag)
                lo, hi, mask = min(lo, plo), max(hi, phi), mask << 1
        _fold_out(k, buf, rem)
        k.step(2 * logq + (2 if rem else 0))
        return k.result(buf)


def _real_rank(v: int, rem: int) -> int:
    """The rank behind virtual rank ``v`` after the fold: of the first 2·rem ranks only the odd ones
    stay in (v < rem), the rest keep their order."""
    return 2 * v + 1 if v < rem else v + rem


def _fold_in(k, buf, tmp, fn, rem) -> int:
    """p not a power of two: even ranks below 2*rem hand their array to the odd neighbour and sit
    out (returns -1); the others get virtual ranks 0..q-1."""
    c = k.comm
    r = c.rank
    if r >= 2 * rem:
        return r - rem
    if r % 2 == 0:
        c.send_buffer(buf, r + 1, k.tag)
        return -1
    incoming = tmp[:buf.size]
    c.recv_buffer(incoming, r - 1, k.tag)
    fn(incoming, buf, out=buf)
    return r // 2


def _fold_out(k, buf, rem) -> None:
    """Hand the result back to the ranks that sat out."""
    c = k.comm
    r = c.rank
    if r < 2 * rem:
        if r % 2 == 1:
            c.send_buffer(buf, r - 1, k.tag)
        else:
            c.recv_buffer(buf, r + 1, k.tag)


