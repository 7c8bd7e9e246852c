"""Calibrate's mpirun probe: what n MPI processes sharing this machine really get.

Processes that outnumber the cores take turns, and every switch costs time and cache. Two things a
training step needs are measured directly, with n processes at once, for n in `PROBE_RANKS`:

* `cores` and `python`: data-parallel training of a small GPT (`_step_time`), one rank alone and
  all n at once, less its gradient all-reduce, with fat and thin kernels (`PROBE_ROWS`: the same
  ops, an eighth of the arithmetic): their difference gives the cores' worth the n processes get,
  and what the thin step loses beyond it is per op, extra seconds per second of Python (measured as
  `HOLLOW_GPT`, the same ops with no arithmetic; `crowd_fit`).
* `links`: the all-reduce as training calls it, all n ranks at once, in wall time: `fg` in the
  foreground (tensor parallel) and `bg` on the communication thread (DDP), each fitted to rounds x
  alpha + bytes x beta (`minidist.plan.traffic`'s), for the ring and shm (`PROBE_ALGORITHMS`).

`probe_processes()` runs `mpiexec -n N python -m minidist.plan.calibrate_mpi` for each n and returns
the entries calibrate stores under "processes"; `minidist.plan.hardware.here(transport="mpi")` reads
them as `Crowd`s. Why these two, and what they predicted: chapter 11 (lessons/11-planning.md,
"Processes (`mpirun`)" and "What really costs time when p ranks share c cores").
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
from threadpoolctl import threadpool_limits

from minidist.comm import all_reduce, all_reduce_async, run
from minidist.nn import GPT, GPTConfig
from minidist.plan.calibrate_cores import fit_link
from minidist.plan.calibrate_kernels import step_seconds
from minidist.plan.clock import _median_time, cpu
from minidist.plan.traffic import DP_ALGORITHM as DDP_ALGORITHM
from minidist.plan.traffic import all_reduce_rounds, all_reduce_sent

PROBE_RANKS = (2, 4, 8)                       # minidist's meshes on one machine: up to 8 ranks
PROBE_SIZES = (1 << 12, 1 << 16, 1 << 20, 1 << 22)
PROBE_ALGORITHMS = ("ring", "shm")           # what DDP and TP ask for, and what "auto" picks under mpirun
_LAUNCH_ENV = ("PMI_", "PMIX_", "HYDRA_", "OMPI_", "MPI_LOCAL", "MINIDIST_TRANSPORT")


PROBE_GPT = GPTConfig(vocab_size=64, block_size=64, n_layer=1, n_head=4, d_model=128)
PROBE_ROWS = (16, 2)                # sequences per rank and step: fat kernels, then thin ones (same ops)
HOLLOW_GPT = GPTConfig(vocab_size=8, block_size=4, n_layer=1, n_head=4, d_model=8)  # PROBE_GPT's ops, no math


def _step_time(comm, rows: int = PROBE_ROWS[0], cfg: GPTConfig = PROBE_GPT, steps: int = 7,
               clock=time.perf_counter) -> float:
    """Median seconds per step (first dropped) of data-parallel training of `cfg` on `comm`, `rows`
    sequences per rank: the slowest rank's. `clock`: wall time, or (one rank alone: no DDP thread)
    its CPU seconds, what the step needs on a core of its own whatever else runs."""
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (rows * comm.size, cfg.block_size))
    mine = float(np.median(step_seconds(comm, cfg, [(ids, ids)] * steps, clock=clock, dp=comm.size)))
    return float(np.max(comm.allgather_obj(mine)))


def crowd_fit(n: int, alone: dict, together: dict, python: float, cpus: int) -> tuple[float, float]:
    """(cores, python) from the probe's timings: n processes' step, less its gradient all-reduce, is
    n / cores x (the step alone + python x its Python), for the fat and the thin step alike
    (`alone`, `together`: rows -> seconds; `python`: seconds of Python in a step alone, the hollow
    GPT's). The fat and thin steps run the same ops, so their difference is arithmetic only: it gives
    n / cores (the slope); what the thin step loses beyond that is per op, a share of the Python.
    cores: at most n, and at most the CPUs; python: at least 0."""
    (fat, thin) = sorted(alone, reverse=True)
    slope = (together[fat] - together[thin]) / max(alone[fat] - alone[thin], 1e-12)
    cores = min(float(n), float(cpus), n / max(slope, 1e-12))
    slope = n / cores
    extra = together[thin] / slope - alone[thin]       # seconds per step beyond the stretched work
    return cores, max(0.0, extra / max(python, 1e-12))


def _asleep_until_all_here() -> None:
    """A barrier whose waiters sleep (MPI's own spins): the rank measuring alone keeps the cores."""
    from mpi4py import MPI  # defers mpi4py (only under mpiexec)

    done = MPI.COMM_WORLD.Ibarrier()
    while not done.Test():
        time.sleep(1e-3)


def _probe_rank(comm) -> dict:
    """One rank of the probe (under mpiexec): the all-reduce links, then the cores' worth."""
    links = {}
    for alg in PROBE_ALGORITHMS:
        fg, bg = [], []
        for nbytes in PROBE_SIZES:
            x = np.ones(nbytes // 4, np.float32)
            fg.append(_median_time(lambda x=x, a=alg: all_reduce(comm, x, algorithm=a), 5, min_time=0))
            bg.append(_median_time(lambda x=x, a=alg: all_reduce_async(comm, x, algorithm=a).wait(), 5,
                                   min_time=0))
        fg, bg = (np.max(comm.allgather_obj(t), axis=0) for t in (fg, bg))
        links[alg] = {"fg": fit_link(alg, comm.size, PROBE_SIZES, fg),
                      "bg": fit_link(alg, comm.size, PROBE_SIZES, bg)}
    grads = 4 * sum(p.size for p in GPT(PROBE_GPT).parameters())  # one DDP bucket, all-reduced on its thread
    alpha, beta = links[DDP_ALGORITHM]["bg"]
    ar = all_reduce_rounds(DDP_ALGORITHM, grads, comm.size) * alpha + \
        all_reduce_sent(DDP_ALGORITHM, grads, comm.size) * beta
    solo = comm.split(comm.rank)      # a one-rank communicator each
    turns = {r: ([], []) for r in PROBE_ROWS}
    hollow = []
    for _ in range(5):  # alone and together in turns: a burst of other work spoils one pair, not the median
        for rows, (alone, together) in turns.items():
            t = _step_time(solo, rows, clock=cpu) if comm.rank == 0 else 0.0
            _asleep_until_all_here()
            alone.append(comm.allgather_obj(t)[0])
            together.append(_step_time(comm, rows) - ar)
        t = _step_time(solo, 1, HOLLOW_GPT, clock=cpu) if comm.rank == 0 else 0.0
        _asleep_until_all_here()
        hollow.append(comm.allgather_obj(t)[0])
    med = {r: (float(np.median(a)), float(np.median(t))) for r, (a, t) in turns.items()}
    cores, python = crowd_fit(comm.size, {r: a for r, (a, _) in med.items()},
                              {r: t for r, (_, t) in med.items()}, float(np.median(hollow)),
                              len(os.sched_getaffinity(0)))
    return {"ranks": comm.size, "cores": cores, "python": python, "links": links,
            "steps": {str(r): v for r, v in med.items()}, "hollow": float(np.median(hollow))}


def probe_processes(ranks=PROBE_RANKS, timeout: float = 120.0) -> list:
    """Run the probe under `mpiexec -n n` for each n; [] without an MPI launcher. The launcher's own
    variables are dropped from the environment, so this works from inside an mpirun rank too."""
    launcher = shutil.which("mpiexec") or shutil.which("mpirun")
    if launcher is None:
        return []
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_ENV)}
    env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    out = []
    for n in ranks:
        done = subprocess.run([launcher, "-n", str(n), sys.executable, "-m", "minidist.plan.calibrate_mpi"],
                              env=env, capture_output=True, text=True, timeout=timeout)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        if done.returncode or not lines:
            raise RuntimeError(f"calibrate's mpirun probe with {n} processes failed (exit "
                               f"{done.returncode}):\n{done.stderr[-2000:]}")
        out.append(json.loads(lines[-1]))
    return out


def main() -> None:
    with threadpool_limits(1):
        res = run(_probe_rank)[0]
    if int(os.environ.get("PMI_RANK", "0")) == 0:
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
