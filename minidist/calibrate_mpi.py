"""Calibrate's mpirun probe: what n MPI processes sharing this machine really get.

Under `mpirun -n N` on a machine with fewer cores than N, processes take turns: a rank waiting for
a message spins (`sched_yield`) and then sleeps, the rank that must send it waits for a time slice,
and every switch costs cache. Two things a training step needs are measured directly, with n
processes at once, for n in `PROBE_RANKS`:

* `cores`: how many cores' worth of minidist work (forward + backward of a small GPT, `_work`) the
  n processes get together -- n x (one rank alone) / (all n at once). Below the core count when the
  processes outnumber the cores, or other programs run.
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

from minidist.calibrate import _median_time, _work
from minidist.comm import all_reduce, all_reduce_async, cost, run
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


def _probe_rank(comm) -> dict:
    """One rank of the probe (under mpiexec): the cores' worth, then the all-reduce links."""
    work = _work(minidist_ops=True, batch=4)
    work()
    comm.barrier()
    alone = _median_time(work, 5, min_time=0) if comm.rank == 0 else 0.0  # the others wait, asleep
    comm.barrier()
    together = []
    for _ in range(5):
        comm.barrier()
        t0 = time.perf_counter()
        work()
        together.append(time.perf_counter() - t0)
    longest = np.max(comm.allgather_obj(together), axis=0)  # per repeat: the last rank to finish
    alone = comm.allgather_obj(alone)[0]
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
    cores = comm.size * alone / float(np.median(longest))
    return {"ranks": comm.size, "cores": min(float(comm.size), cores), "links": links}


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
