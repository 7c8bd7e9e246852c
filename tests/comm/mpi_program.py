"""Run under ``mpirun -n P`` by test_mpirun.py: ``python mpi_program.py MODE``.

check: every collective == NumPy, ledger == formula, p2p, split, mesh, async; prints "OK rank r".
fail:  rank 1 raises -> the whole job must end (abort), not hang.
stuck: rank 0 waits for a message never sent -> the watchdog fires (MINIDIST_TIMEOUT) and aborts.
stuck_in_collective: rank 0 in its 2nd all-reduce, rank 1 in a recv -> the watchdog names both.
long_twin: rank 0 computes 3 s (a serial twin) while the others wait in a broadcast: no "still waiting".
dtype_mismatch: float64[8] against float32[16] (same bytes) -> CollectiveMismatch, not garbage.
early_return: rank 1 returns from its function while rank 0 waits for it -> RankExited at once.
exit0: rank 1 calls os._exit(0) mid-run -> the job exits nonzero, naming it.
after_abort: rank 1 raises; the code after run() must never run on it.
"""

import sys

import numpy as np

from minidist.comm import (
    Mesh,
    all_gather,
    all_reduce,
    all_reduce_async,
    all_to_all,
    broadcast,
    measure,
    reduce_scatter,
    ring_all_reduce,
    run,
)

ALGOS = ("ring", "recursive_doubling", "halving_doubling", "two_shot", "tree", "naive", "mpi", "auto")


def check(comm):
    p, r = comm.size, comm.rank
    assert comm.transport == "mpi"
    rng = np.random.default_rng(0)  # same stream on every rank: everyone knows everyone's input
    for n in (0, 1, 7, 1000, 40_000):
        for dtype in ("float32", "int64"):
            xs = [(rng.standard_normal(n) * 10).astype(dtype) for _ in range(p)]
            for op in ("sum", "max", "min"):
                want = {"sum": np.sum, "max": np.max, "min": np.min}[op](np.stack(xs), axis=0).astype(dtype)
                for algo in ALGOS:
                    got = all_reduce(comm, xs[r], op=op, algorithm=algo)
                    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3, err_msg=f"{algo} {op} {n}")
    x = np.ones(p * 1000, np.float32)
    with measure(comm) as m:
        ring_all_reduce(comm, x)
    assert m.bytes_sent == 2 * (p - 1) * x.nbytes // p and m.steps == 2 * (p - 1), m
    rs = reduce_scatter(comm, np.arange(10.0).reshape(5, 2) + r, axis=1)
    assert rs.shape == (5, len(np.array_split(range(2), p)[r]))
    ag = all_gather(comm, np.full((r + 1, 2), r))
    assert ag.shape == (p * (p + 1) // 2, 2) and ag[-1, 0] == p - 1
    b = broadcast(comm, np.arange(3) if r == p - 1 else None, root=p - 1)
    assert b.tolist() == [0, 1, 2]
    t = all_to_all(comm, [np.array([r, j]) for j in range(p)])
    assert [a.tolist() for a in t] == [[i, r] for i in range(p)]
    h = [all_reduce_async(comm, np.full(5000, float(k))) for k in range(3)]
    assert [float(hh.wait()[0]) for hh in h] == [float(k * p) for k in range(3)]
    # large messages both ways at once (past MPI's eager limit): each rank's blocking send must
    # still take in the message coming to it, or the exchange deadlocks
    big = np.full(1 << 20, float(r))
    got = comm.sendrecv(big, (r + 1) % p, (r - 1) % p)
    assert got.shape == big.shape and got[0] == (r - 1) % p
    assert all_gather(comm, big[: 300_000]).shape == (300_000 * p,)
    ag = all_gather(comm, big[: 300_000], sizes="equal")  # header-free, straight into the output
    assert ag.shape == (300_000 * p,) and ag[300_000 * (p - 1)] == p - 1
    reqs = [comm.irecv((r - 1) % p, tag=2) for _ in range(3)]
    for k in range(3):
        comm.send(np.full(k + 1, k), (r + 1) % p, tag=2)
    assert [q.wait().tolist() for q in reqs] == [[k] * (k + 1) for k in range(3)]
    if p % 2 == 0:
        mesh = Mesh(comm, dp=p // 2, tp=2)
        s = all_reduce(mesh.tp, np.array([r]))
        assert s[0] == 2 * (r - r % 2) + 1
    import ml_dtypes  # dtypes MPI doesn't know travel as bytes, with their name in the header

    bf = comm.sendrecv(np.arange(3).astype(ml_dtypes.bfloat16), (r + 1) % p, (r - 1) % p)
    assert bf.dtype == ml_dtypes.bfloat16 and bf.astype(float).tolist() == [0, 1, 2]
    assert not comm.channel("coll")._pending  # every call has its own tags: no table of them may grow
    comm.barrier()
    print(f"OK rank {r}", flush=True)


def fail(comm):
    if comm.rank == 1:
        raise RuntimeError("deliberate failure on rank 1")
    all_reduce(comm, np.ones(10))  # the others wait for rank 1


def stuck(comm):
    if comm.rank == 0:
        comm.recv(comm.size - 1, tag=7)
    comm.barrier()


def stuck_in_collective(comm):
    all_reduce(comm, np.ones(3), algorithm="ring")
    if comm.rank == 0:
        all_reduce(comm, np.ones(3), algorithm="ring")
    else:
        comm.recv(0, tag=3)


def long_twin(comm):
    import time

    if comm.rank == 0:
        time.sleep(3.0)  # the serial twin: 3 s on rank 0 alone (not in a wait: the board says "working")
    print(f"rank {comm.rank} got {comm.bcast_obj('twin done', root=0)}", flush=True)


def dtype_mismatch(comm):
    x = np.ones(8) if comm.rank == 0 else np.ones(16, np.float32)
    print(f"rank {comm.rank} got {all_reduce(comm, x, algorithm='ring')}", flush=True)


def early_return(comm):
    if comm.rank != 1:
        all_reduce(comm, np.ones(3), algorithm="ring")


def exit0(comm):
    import os

    if comm.rank == 1:
        os._exit(0)
    all_reduce(comm, np.ones(3), algorithm="ring")


def clock(comm):
    """Virtual clock (MINIDIST_CLOCK=virtual, a 1 ms, 1 MB/s link): a header message, a raw one, a
    background one, a ring all-reduce; each rank prints its virtual times."""
    from minidist.comm import ring_all_reduce
    from minidist.trace.clock import now

    times = []
    if comm.rank == 0:
        comm.clock.advance(0.1)
        comm.send(np.zeros(2000, np.uint8), 1)                  # done 0.102; arrives 0.103
        times.append(now())
        req = comm.isend(np.zeros(100_000, np.uint8), 1)       # busy 0.1 s from 0.102
        comm.clock.advance(0.3)
        req.wait()
        times.append(now())                                     # 0.402: hidden
    elif comm.rank == 1:
        comm.recv(0)
        times.append(now())                                     # 0.103
        comm.recv(0, out=np.empty(100_000, np.uint8))
        times.append(now())                                     # 0.102 + 0.001 + 0.1 = 0.203
    base = max(comm.allgather_obj(now()))  # (objects cost their own messages: measure from here)
    comm.clock.resume(base)
    ring_all_reduce(comm, np.ones(6000 * comm.size))            # 2(p-1) steps of 48000 bytes
    times.append(now() - base)
    every = comm.gather_obj(times)  # rank 0 prints them all: lines of several processes can interleave
    for r, ts in enumerate(every or []):
        print(f"CLOCK rank {r} " + " ".join(f"{t:.6f}" for t in ts), flush=True)


if __name__ == "__main__":
    modes = {"check": check, "fail": fail, "stuck": stuck, "stuck_in_collective": stuck_in_collective,
             "dtype_mismatch": dtype_mismatch, "early_return": early_return, "exit0": exit0,
             "after_abort": fail, "clock": clock, "long_twin": long_twin}
    run(modes[sys.argv[1]])
    print(f"AFTER RUN {sys.argv[1]}", flush=True)
    if len(sys.argv) > 2:  # a file, written at once: a rank that carries on after aborting leaves it
        from mpi4py import MPI

        open(f"{sys.argv[2]}.{MPI.COMM_WORLD.Get_rank()}", "w").close()
