"""The textbook formula beside this machine's prediction: one line a lesson prints under its measurement.

A textbook step-time formula assumes every rank has a chip of its own: compute split N ways, plus the
collectives' alpha-beta time, with DDP's all-reduce hidden behind backward. On a laptop or a shared
2-core machine the N ranks share C cores, so each rank's work runs about N / C times slower and
nothing overlaps -- the measurement then "contradicts" the formula although both are right. The
planner (``minidist.plan.steptime.predict``, chapter 11) has both models, on this machine's calibrated
constants (``python -m minidist.calibrate``): ``textbook(hw)`` is the machine with a core per rank,
``hw`` itself is the machine as it is. The lessons print

    DDP step: formula X ms (a core per rank), this machine predicted Y ms (4 ranks on 2 cores:
    each rank's work 2.0x slower), measured Z ms

so a student can see what would make formula and measurement agree: a core (or chip) per rank.
"""

from __future__ import annotations

import os

from minidist.plan.estimates import machine
from minidist.plan.mesh import Candidate, Settings
from minidist.plan.model import ModelSpec
from minidist.plan.steptime import predict, rank_slowdown


def textbook(hw):
    """``hw`` with a core per rank and nothing shared: no cores to take turns on, no shared GIL, no
    crowded MPI processes (their probed links too), as the textbook formulas assume."""
    return hw.with_(cores=0, cores_crowded=0, crowds=(), threads=(), cores_one=0, gil=False)


def step_times(hw, n_layer: int, d_model: int, n_head: int, vocab: int, seq: int, batch: int, *, dp: int = 1,
               tp: int = 1, microbatches: int = 1, dtype_bytes: int = 4) -> tuple[float, float]:
    """(formula, this machine) seconds per AdamW step of a minidist GPT: the planner on ``textbook(hw)``
    and on ``hw``. ``batch``: the global batch in sequences, run as ``microbatches`` per replica."""
    model = ModelSpec("lesson", n_layer=n_layer, d_model=d_model, n_head=n_head, vocab=vocab, seq=seq,
                      engine="minidist", dtype_bytes=dtype_bytes)
    cand = Candidate(dp=dp, tp=tp, microbatch_size=max(batch // (dp * microbatches), 1))
    return (predict(model, cand, batch, textbook(hw), Settings("adamw")).step,
            predict(model, cand, batch, hw, Settings("adamw")).step)


def cores(hw=None) -> int:
    """The CPUs the ranks share: the calibration's count, else the ones this process may run on."""
    return int(getattr(hw, "cpus", 0) or len(os.sched_getaffinity(0)))


def compare_line(what: str, measured: float, ranks: int, hw=None, **shape) -> str:
    """One line: ``what: formula X ms (a core per rank), this machine predicted Y ms (N ranks on C
    cores: ...), measured Z ms``. ``shape``: ``step_times``' model and mesh arguments; ``hw``: the
    machine (``this_machine``); None (not calibrated yet): the measurement and how to get predictions."""
    c = cores(hw)
    if hw is None:
        return f"{what}: measured {ms(measured)} ({ranks} rank{'s' * (ranks != 1)} on {c} cores; " \
               "`python -m minidist.calibrate` gives the formula's and this machine's predictions)"
    formula, here = step_times(hw, **shape)
    slow = rank_slowdown(hw, ranks)
    return (f"{what}: formula {ms(formula)} (a core per rank), this machine predicted {ms(here)} "
            f"({ranks} rank{'s' * (ranks != 1)} on {c} cores: each rank's work {slow:.1f}x slower), "
            f"measured {ms(measured)}")


def ms(seconds: float) -> str:
    """Milliseconds to 3 significant digits: a GPU preset's 0.0123 ms as readable as a CPU's 82.7 ms."""
    return f"{seconds * 1e3:.3g} ms"


def this_machine(transport: str):
    """This machine's calibrated Hardware for ``transport`` ("mpi" or "threads"), or None."""
    return machine("mpi" if transport == "mpi" else "threads")
