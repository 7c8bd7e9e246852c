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
    from minidist.parallel.data import DDP

    cfg = GPTConfig()
    m = GPT(cfg)
    ddp = DDP(m, comm, bucket_bytes=args.bucket_mb * (1 << 20))
    opt = optim.AdamW(m.parameters(), lr=1e-4)
    rng = np.random.default_rng(comm.rank)
    x = rng.integers(0, cfg.vocab_size, (args.batch, cfg.block_size))
    times, hidden = [], []
    for i in range(args.steps + 2):
        comm.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        ddp.backward(m.loss(x, x))
        ddp.wait_gradients()
        opt.step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
            hidden.append(ddp.hidden_fraction())
    return float(np.median(times)), float(np.median(hidden)), m.num_parameters(), len(ddp.buckets)


def torch_gpt(cfg):
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.h = h
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            d = cfg.d_model
            self.wte, self.wpe = nn.Embedding(cfg.vocab_size, d), nn.Embedding(cfg.block_size, d)
            self.blocks = nn.ModuleList(Block(d, cfg.n_head) for _ in range(cfg.n_layer))
            self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, cfg.vocab_size, bias=False)

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for blk in self.blocks:
                x = blk(x)
            logits = self.head(self.ln(x))
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    return GPT()


def torch_steps(rank, size, args):
    import torch
    import torch.distributed as dist

    from minidist.nn import GPTConfig

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", args.port, size, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
    cfg = GPTConfig()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch_gpt(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = np.random.default_rng(rank)
    x = torch.from_numpy(rng.integers(0, cfg.vocab_size, (args.batch, cfg.block_size)))
    times = []
    for i in range(args.steps + 2):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x, x).backward()
        opt.step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    flat = torch.zeros(sum(p.numel() for p in model.parameters()))
    ar = []
    for _ in range(5):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(flat)
        ar.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    return float(np.median(times)), float(np.median(ar))


def rank_main(comm, args):
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1):
        ours, hidden, psi, nb = minidist_steps(comm, args)
    theirs, gloo_ar = torch_steps(comm.rank, comm.size, args)
    if comm.rank == 0:
        print(f"GPT {psi / 1e6:.2f} M float32 parameters, batch {args.batch} per rank, {comm.size} ranks, "
              f"1 thread each, median of {args.steps} steps")
        print(f"  minidist DDP   {ours * 1e3:8.1f} ms/step   ({nb} buckets of <= {args.bucket_mb} MiB, "
              f"{hidden:.0%} of all-reduce time hidden behind backward)")
        print(f"  PyTorch DDP    {theirs * 1e3:8.1f} ms/step   (gloo; a bare all-reduce of all gradients "
              f"takes {gloo_ar * 1e3:.1f} ms)")
        print(f"  ratio minidist / PyTorch = {ours / theirs:.2f}  (target <= 1.25)", flush=True)


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
    run(rank_main, args=args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
