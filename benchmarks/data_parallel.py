"""minidist DDP against PyTorch DDP (gloo), same GPT, same run: step time and hidden all-reduce time.

    mpirun -n 2 python benchmarks/data_parallel.py          # needs torch (CPU); exits 0 without it
    python benchmarks/data_parallel.py                      # starts the mpirun itself

The GPT of the core benchmark (vocab 256, context 128, 4 layers, d_model 256, float32: 3.3 M
parameters), batch 8 per rank, one BLAS/intra-op thread per rank. Each rank times forward +
backward + gradient sync + AdamW for minidist DDP, then for ``torch.nn.parallel.DDP`` on a gloo
process group (TCP store on 127.0.0.1), medians over ``--steps``. Also: the share of minidist's
bucket all-reduce time that ran while backward was still computing, and a bare gloo all-reduce of
all the gradients for scale. Target: ratio minidist / PyTorch <= 1.25.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import subprocess
import sys
import time

import numpy as np


def minidist_steps(comm, args):
    from minidist import optim
    from minidist.nn import GPT, GPTConfig
    from minidist.parallel.ddp import DDP

    cfg = GPTConfig()
    m = GPT(cfg)
    ddp = DDP(m, comm, bucket_bytes=args.bucket_mb * (1 << 20))
    opt = optim.AdamW(m.parameters(), lr=1e-4)
    rng = np.random.default_rng(comm.rank)
    x = rng.integers(0, cfg.vocab_size, (args.batch, cfg.block_size))
    times, hidden, losses = [], [], []
    for i in range(args.steps + 2):
        comm.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = m.loss(x, x)
        ddp.backward(loss)
        ddp.wait_gradients()
        opt.step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
            hidden.append(ddp.hidden_fraction())
        losses.append(loss.item())
    return float(np.median(times)), float(np.median(hidden)), m.num_parameters(), len(ddp.buckets), losses


def torch_steps(rank, size, args):
    import torch
    import torch.distributed as dist
    from torch_gpt import from_minidist

    from minidist.nn import GPT, GPTConfig

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", args.port, size, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
    cfg = GPTConfig()
    model = torch.nn.parallel.DistributedDataParallel(from_minidist(GPT(cfg).state_dict(), cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = np.random.default_rng(rank)
    x = torch.from_numpy(rng.integers(0, cfg.vocab_size, (args.batch, cfg.block_size)))
    times, losses = [], []
    for i in range(args.steps + 2):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = model(x, x)
        loss.backward()
        opt.step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    flat = torch.zeros(sum(p.numel() for p in model.parameters()))
    ar = []
    for _ in range(5):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(flat)
        ar.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    return float(np.median(times)), float(np.median(ar)), losses


def rank_main(comm, args):
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1):
        ours, hidden, psi, nb, our_losses = minidist_steps(comm, args)
    theirs, gloo_ar, their_losses = torch_steps(comm.rank, comm.size, args)
    agree = all(abs(a - b) <= 1e-3 * abs(b) for a, b in zip(our_losses, their_losses))
    if comm.rank == 0:
        print(f"rank 0 losses, steps 1 and {len(our_losses)} (same weights and batches: they must agree): "
              f"minidist {our_losses[0]:.6f} {our_losses[-1]:.6f}  "
              f"PyTorch {their_losses[0]:.6f} {their_losses[-1]:.6f}  {'PASS' if agree else 'FAIL'}")
        print(f"GPT {psi / 1e6:.2f} M float32 parameters, batch {args.batch} per rank, {comm.size} ranks, "
              f"1 thread each, median of {args.steps} steps")
        print(f"  minidist DDP   {ours * 1e3:8.1f} ms/step   ({nb} buckets of <= {args.bucket_mb} MiB, "
              f"{hidden:.0%} of all-reduce time hidden behind backward)")
        print(f"  PyTorch DDP    {theirs * 1e3:8.1f} ms/step   (gloo; a bare all-reduce of all gradients "
              f"takes {gloo_ar * 1e3:.1f} ms)")
        print(f"  ratio minidist / PyTorch = {ours / theirs:.2f}  (target <= 1.25)", flush=True)
    return bool(comm.bcast_obj(agree, root=0))  # every rank exits with rank 0's verdict


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--bucket-mb", type=float, default=4)
    ap.add_argument("--port", type=int, default=29517)
    args = ap.parse_args()
    try:
        import torch  # noqa: F401
    except ImportError:
        print("benchmarks/data_parallel.py needs PyTorch (pip install torch): skipped")
        return 0
    from minidist.comm import run, under_mpi

    if not under_mpi():
        if shutil.which("mpirun") is None:
            print("needs mpirun (pip install mpich): skipped")
            return 0
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
        return subprocess.call(["mpirun", "-n", "2", sys.executable, __file__, *sys.argv[1:]], env=env)
    if not all(run(rank_main, args=args)):
        print("FAIL: minidist DDP and PyTorch DDP losses disagree", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
