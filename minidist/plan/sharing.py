"""Ranks sharing this machine's cores: how much slower each rank's work, Python and messages run.

A preset's chips each have their own device (every factor here is 1). On this machine
(`--hardware here`) ranks may outnumber the cores: processes get the free cores (calibrate's mpirun
probe, `Hardware.crowd`), thread ranks share one GIL (`Hardware.thread_cores`).
"""

from __future__ import annotations

from minidist.plan.hardware import Hardware
from minidist.plan.traffic import Placement

LINK_RANKS = 2        # thread ranks calibrate measures the threads link with (`allreduce_alpha_beta`)


def python_crowding(hw: Hardware, ranks: int) -> float:
    """How many times longer a rank's Python takes when `ranks` MPI processes outnumber this machine's
    CPUs, before the sharing itself (`rank_slowdown`): 1 + the probe's `python`. Processes that
    outnumber the cores take turns: one switched back in finds its caches holding another's arrays
    and interpreter state, and every wait for a partner is a switch -- costs that come per op, so a
    step of many thin ops loses more than one of few fat ones. 1 while each process has a CPU (no
    turns to take), for thread ranks (one process: `rank_slowdown` measures their sharing whole)
    and for presets."""
    crowd = hw.crowd(ranks)
    return 1.0 + crowd.python if crowd is not None and hw.cpus and ranks > hw.cpus else 1.0


def placement(hw: Hardware, ranks: int) -> Placement:
    """The transport `ranks` ranks run on here, whether they outnumber the CPUs, and (MPI here: one
    machine) that they share its memory: what the comm layer's "auto" all-reduce looks at. Presets:
    never crowded."""
    return Placement(hw.transport or "threads", bool(hw.cpus) and ranks > hw.cpus, hw.transport == "mpi")


def rank_slowdown(hw: Hardware, ranks: int) -> float:
    """How many times slower each of `ranks` ranks runs when they share this machine's cores: ranks /
    the cores' worth of work they get together (1 where every rank has its own chip).

    One rank alone: the share of a core calibrate found one rank gets (`hw.cores_one`: 1 on a quiet
    machine, less when other programs take turns on its core).
    MPI processes: the cores' worth calibrate's mpirun probe measured for that many processes doing
    minidist work at once (`hw.crowd`: once they outnumber the CPUs they take turns, and every switch
    costs cache), else the cores calibrate found free. Thread ranks share one GIL: only one runs
    Python at a time, and every time one releases it for a NumPy kernel another must be woken to
    take it. While the ranks fit on the cores that hand-off is quick; once they outnumber the cores,
    the rank woken for the GIL has to wait for a core that other ranks' kernels hold, so Python,
    kernels and messages end up taking turns, the more so the more ranks and the thinner their
    kernels: `hw.thread_cores(ranks)`, measured by calibrate for as many thread ranks as the CPUs,
    2 x and 4 x as many, a fixed batch split over them (8 ranks on a 2-vCPU machine: ~0.6-0.8 of a
    core, the hand-offs cost more than they save; 4 ranks more than that)."""
    crowd = hw.crowd(ranks)
    if crowd is not None:
        return max(1.0, ranks / crowd.cores)
    if ranks == 1 and hw.cores_one:  # one rank, thread or process: the share of a core it gets alone
        return max(1.0, 1.0 / hw.cores_one)
    if not hw.cores:
        return 1.0
    return max(1.0, ranks / (hw.thread_cores(ranks) if hw.gil else hw.cores))


def comm_slowdown(hw: Hardware, ranks: int) -> float:
    """How many times slower messages run than `collective_time` says. Thread ranks' messages (and
    MPI processes' without calibrate's probe) are priced at the threads link, which calibrate
    measured with `LINK_RANKS` ranks sharing the machine -- their sharing is in it already; with
    more ranks, the messages' Python takes its turn with the rest: rank_slowdown(ranks) /
    rank_slowdown(LINK_RANKS) (the same rule as a crowded MPI group's link, `collective_time`). MPI
    processes' probed links are priced in `collective_time` (1 here)."""
    if hw.crowd(ranks) is not None:
        return 1.0
    return max(1.0, rank_slowdown(hw, ranks) / rank_slowdown(hw, min(ranks, LINK_RANKS)))

