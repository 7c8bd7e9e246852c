"""Calibrate's mpirun probe: what n MPI processes sharing this machine really get.

Under `mpirun -n N` on a machine with fewer cores than N, processes take turns: a rank waiting for
a message spins (`sched_yield`) and then sleeps, the rank that must send it waits for a time slice,
and every switch costs cache. Two things a training step needs are measured directly, with n
processes at once, for n in `PROBE_RANKS`:

* `cores`: how many cores' worth of minidist training work the n processes get together: the step
  time of data-parallel training of a small GPT (`_step_time`, the same rows per rank) on one rank
  alone and on all n at once, n x alone / (together - its gradient all-reduce, priced by the `bg`
  link below). Below the core count when the processes outnumber the cores -- every wait for a
  partner, every wake-up of the communication thread is a switch that costs the next rank its
  caches -- or when other programs run.
* `links`: the all-reduce as the training step calls it, all n ranks at once, as wall time:
  `fg` called in the foreground (tensor parallelism: `all_reduce` between matmuls) and `bg` on the
  communication thread (DDP's gradient buckets: `all_reduce_async`), each fitted to
  rounds x alpha + bytes sent x beta over message sizes (the planner's rounds and bytes of each
  algorithm, `minidist.plan.traffic`), for the ring (what DDP and the TP layers ask for) and shm
  (what "auto" picks under mpirun). Crowding shows up in alpha: each round waits until the
  partners are scheduled.

`probe_processes()` starts `mpiexec -n N python -m minidist.calibrate_mpi` for each n and returns
the entries calibrate stores under "processes"; `minidist.hardware.here(transport="mpi")` reads
them as `Crowd`s.
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

from minidist.calibrate import _median_time
from minidist.comm import all_reduce, all_reduce_async, cost, run
from minidist.nn import GPT, GPTConfig
from minidist.parallel.three_d import train_3d
from minidist.plan.traffic import DP_ALGORITHM as DDP_ALGORITHM
from minidist.plan.traffic import Placement, all_reduce_rounds, all_reduce_sent

PROBE_RANKS = (2, 4, 8)                       # minidist's meshes on one machine: up to 8 ranks
PROBE_SIZES = (1 << 12, 1 << 16, 1 << 20, 1 << 22)
PROBE_ALGORITHMS = ("ring", "shm")           # what DDP and TP ask for, and what "auto" picks under mpirun
_LAUNCH_ENV = ("PMI_", "PMIX_", "HYDRA_", "OMPI_", "MPI_LOCAL", "MINIDIST_TRANSPORT")


def fit_alpha_beta(algorithm: str, p: int, sizes, times) -> tuple[float, float]:
    """Least squares of time = rounds x alpha + bytes sent x beta over the message sizes (float32),
    rounds and bytes as the planner counts them (`minidist.plan.traffic`)."""
    where = Placement("mpi", cost.crowded(), shared_memory=True)  # this host, as the comm layer sees it
    rows = [(all_reduce_rounds(algorithm, n, p, where=where), all_reduce_sent(algorithm, n, p, where=where))
            for n in sizes]
    (alpha, beta), *_ = np.linalg.lstsq(np.array(rows, float), np.array(times, float), rcond=None)
    return max(float(alpha), 1e-7), max(float(beta), 1e-12)


PROBE_GPT = GPTConfig(vocab_size=64, block_size=64, n_layer=1, n_head=4, d_model=128)
PROBE_ROWS = 16                     # sequences per rank and step


def _step_time(comm, steps: int = 5) -> float:
    """Median seconds per step (first dropped) of data-parallel training of PROBE_GPT on `comm`,
    PROBE_ROWS sequences per rank: the slowest rank's."""
    ids = np.random.default_rng(0).integers(0, PROBE_GPT.vocab_size, (PROBE_ROWS * comm.size, 64))
    marks = []
    train_3d(comm, PROBE_GPT, [(ids, ids)] * steps, dp=comm.size, optimizer="adamw", lr=1e-3,
             on_step=lambda s, st: marks.append(time.perf_counter()))
    return float(np.max(comm.allgather_obj(float(np.median(np.diff(marks)[1:])))))


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
        links[alg] = {"fg": fit_alpha_beta(alg, comm.size, PROBE_SIZES, fg),
                      "bg": fit_alpha_beta(alg, comm.size, PROBE_SIZES, bg)}
    grads = 4 * sum(p.size for p in GPT(PROBE_GPT).parameters())  # one DDP bucket, all-reduced on its thread
    alpha, beta = links[DDP_ALGORITHM]["bg"]
    where = Placement("mpi", cost.crowded(), shared_memory=True)
    ar = all_reduce_rounds(DDP_ALGORITHM, grads, comm.size, where=where) * alpha + \
        all_reduce_sent(DDP_ALGORITHM, grads, comm.size, where=where) * beta
    solo, ratios = comm.split(comm.rank), []      # a one-rank communicator each
    for _ in range(3):  # alone and together in turns: a burst of other work spoils one pair, not the median
        alone = _step_time(solo) if comm.rank == 0 else 0.0
        _asleep_until_all_here()
        alone = comm.allgather_obj(alone)[0]
        ratios.append(comm.size * alone / max(_step_time(comm) - ar, alone))
    # n processes can't get more than n cores, nor more than the CPUs this process may use
    cores = min(float(comm.size), float(len(os.sched_getaffinity(0))), float(np.median(ratios)))
    return {"ranks": comm.size, "cores": cores, "links": links}


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
        done = subprocess.run([launcher, "-n", str(n), sys.executable, "-m", "minidist.calibrate_mpi"],
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
