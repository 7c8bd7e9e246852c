"""Which link each mesh axis runs on, and what one call of a collective costs there (alpha-beta).

tp (fastest, innermost ranks) inside a node / ICI; dp inside the node while tp·dp fits there, else
hierarchically (inside, then across); pp across nodes once tp·dp fills one. On this machine
(`--hardware here` under mpirun) the links are the ones calibrate's probe measured for that many
processes (`Hardware.crowd`).
"""

from __future__ import annotations

import functools

from minidist.plan.hardware import Hardware, Link
from minidist.plan.mesh import Candidate
from minidist.plan.sharing import rank_slowdown
from minidist.plan.traffic import all_reduce_rounds


@functools.lru_cache(maxsize=1024)
def _largest_divisor(n: int, cap: int) -> int:
    """The largest divisor of n that is at most cap (how many of an axis' ranks share a domain)."""
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def axis_link(hw: Hardware, cand: Candidate, axis: str) -> tuple[Link, int, Link | None, int]:
    """(inner link, ranks on it, outer link or None, ranks across) for a mesh axis."""
    dom = hw.chips_per_domain
    if axis == "tp":
        return (hw.intra, cand.tp, None, 1) if cand.tp <= dom else (hw.inter, cand.tp, None, 1)
    if axis in ("cp", "ep"):
        inner = cand.tp * (cand.cp if axis == "cp" else cand.ep)
        return (hw.intra if inner <= dom else hw.inter), (cand.cp if axis == "cp" else cand.ep), None, 1
    if axis == "dp":
        fits = dom // max(1, cand.tp)  # dp ranks of one tp coordinate inside a domain
        inside = _largest_divisor(cand.dp, max(1, fits))
        if inside >= cand.dp:
            return hw.intra, cand.dp, None, 1
        return hw.intra, inside, hw.inter, cand.dp // inside
    # pp: the outermost axis
    return (hw.intra if cand.tp * cand.dp * cand.pp <= dom else hw.inter), cand.pp, None, 1


def collective_time(hw: Hardware, cand: Candidate, c) -> float:
    """Seconds for one call of collective `c`: its algorithm's rounds x latency + bytes / bandwidth; a
    data-parallel axis split over two links reduces inside first, then sends 1/inside of the bytes
    across.

    MPI processes on this machine (`hw.crowd`). DDP's buckets (dp) go through the communication
    thread at the end of the backward, when every process is all-reducing: the link calibrate's probe
    measured with all the mesh's processes all-reducing at once (`background`), wall time, crowding
    included, not stretched again. Every other collective (tp, cp, ep, pp) is called between
    computations by its own group while the other processes compute: the link the probe measured
    for a group of that size alone, its rounds' work then taking turns with the rest of the mesh --
    stretched by rank_slowdown(mesh) / rank_slowdown(group). (A round all-reduced by a crowd of 8
    that does nothing else is far slower than a pair's alone: pricing a tp pair's rounds inside
    8 computing processes at the crowd's rate makes a 3D mesh too slow; chapter 11 has the numbers.)"""
    crowd = hw.crowd(cand.chips)
    stretch = 1.0
    if crowd is not None:
        p, outer, q = axis_size(cand, c.axis), None, 1
        if c.axis == "dp":
            link = crowd.link(algorithm(c) or "ring", background=True)
        else:
            group = hw.crowd(p) or crowd
            link = group.link(algorithm(c) or "ring", background=False)
            stretch = rank_slowdown(hw, cand.chips) / rank_slowdown(hw, group.ranks)
    else:
        link, p, outer, q = axis_link(hw, cand, c.axis)
    if c.axis == "pp":
        return stretch * (link.latency + c.sent / link.bandwidth)
    if outer is None or q == 1:
        return stretch * (rounds(c, p) * link.latency + c.sent / link.bandwidth)
    passes = 2 if algorithm(c) else 1  # reduce-scatter + all-gather, or one of them
    inside = passes * (p - 1) * link.latency + passes * (p - 1) / p * c.payload / link.bandwidth
    across = passes * (q - 1) * outer.latency + passes * (q - 1) / q * c.payload / p / outer.bandwidth
    return inside + across


def algorithm(c) -> str:
    """The all-reduce algorithm of collective `c` ("ring" for "ring_all_reduce"), or "" if it is not one."""
    return c.name[:-len("_all_reduce")] if c.name.endswith("_all_reduce") else ""


def rounds(c, p: int) -> int:
    """Message rounds of one call on p ranks: an all-reduce's per its algorithm
    (`minidist.plan.traffic.all_reduce_rounds`), one ring pass (p-1) for the others."""
    return all_reduce_rounds(algorithm(c), c.payload, p) if algorithm(c) else p - 1


def axis_size(cand: Candidate, axis: str) -> int:
    return {"tp": cand.tp, "dp": cand.dp, "pp": cand.pp, "cp": cand.cp, "ep": cand.ep}[axis]

