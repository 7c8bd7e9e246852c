"""Checkpointing measured: the training stall of a synchronous vs an asynchronous save, and the
recovery time from each tier (shared memory vs disk).

    python benchmarks/checkpoint.py [--repeats 3] [--mb 100] [--disk DIR]

The state: a float32 GPT (d_model 512) with as many layers as make parameters + AdamW's m and v
about ``--mb`` MB, after one training step. One rank. For each repeat, interleaved: a synchronous
save (snapshot, write, fsync, sha256, manifest, rename: training waits for all of it) and an
asynchronous one (training waits for the snapshot to host memory only; a background thread writes),
then the step time of training steps run while that background write is going on vs without one.
Then ``restore`` from the shared-memory tier and from the disk tier. Target: async stall <= 10%
of the synchronous save time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from bench_env import Targets, clock_flags, print_machine, use_clock  # noqa: E402

from minidist.comm import run  # noqa: E402
from minidist.nn import GPT, GPTConfig  # noqa: E402
from minidist.nn.optim import AdamW  # noqa: E402
from minidist.resilience.checkpoint import TrainState  # noqa: E402
from minidist.resilience.checkpoint.tiers import Checkpointer, Tier, shm_root  # noqa: E402


def build(mb: float):
    d = 512
    per_layer = 12 * d * d + 13 * d
    layers = max(1, round((mb * 1e6 / 12 - 2 * 256 * d) / per_layer))
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=layers, n_head=8, d_model=d, dtype="float32")
    model = GPT(cfg)
    opt = AdamW(model.parameters(), lr=1e-3)
    x = np.random.default_rng(0).integers(0, 256, (1, 32))

    def step():
        model.loss(x, x).backward()
        opt.step()
        opt.zero_grad()
    step()
    return model, opt, step


def body(comm, args):
    model, opt, step = build(args.mb)
    state = TrainState(model=model, optimizer=opt)
    nbytes = 3 * sum(p.data.nbytes for p in model.parameters())
    disk = args.disk or tempfile.mkdtemp(prefix="minidist-bench-ckpt-")
    mem = shm_root("bench")
    shutil.rmtree(mem, ignore_errors=True)
    sync = Checkpointer(comm, [Tier("disk", disk, 1, keep=1)], asynchronous=False)
    asyn = Checkpointer(comm, [Tier("disk", disk, 1, keep=1)], asynchronous=True)
    t_step = []
    for _ in range(2):
        t0 = time.perf_counter()
        step()
        t_step.append(time.perf_counter() - t0)
    t_plain, t_busy, s = [], [], 1
    for _ in range(args.repeats):
        s += 1
        sync.maybe_save(s, state)
        t0 = time.perf_counter()
        step()
        t_plain.append(time.perf_counter() - t0)
        s += 1
        asyn.maybe_save(s, state)
        t0 = time.perf_counter()
        step()  # runs while the background thread writes
        t_busy.append(time.perf_counter() - t0)
        asyn.wait()
    sync_s, async_s = float(np.median(sync.stalls)), float(np.median(asyn.stalls))
    write_s = float(np.median([w for _, _, w in asyn.written]))
    print(f"state: {nbytes / 1e6:.0f} MB (parameters + AdamW m, v; {model.config.n_layer} layers of "
          "d_model 512)")
    print(f"  synchronous save: training stalls {1e3 * sync_s:8.1f} ms  ({nbytes / sync_s / 1e9:.2f} GB/s)")
    print(f"  asynchronous:     training stalls {1e3 * async_s:8.1f} ms  (snapshot to host memory); the "
          f"background write takes {1e3 * write_s:.1f} ms")
    ratio = async_s / sync_s
    targets = Targets()
    targets.check("async stall / sync save", ratio, "<=", 0.10)
    print(f"  a training step: {1e3 * np.median(t_plain):.1f} ms alone, {1e3 * np.median(t_busy):.1f} ms "
          "while the background write runs")
    # recovery per tier
    tiers = Checkpointer(comm, [Tier("memory", mem, 1, keep=1), Tier("disk", disk, 0)], asynchronous=False)
    s += 1
    tiers.maybe_save(s, state)
    for name, tier_list in (("memory (/dev/shm)", [Tier("memory", mem, 1)]),
                            ("disk", [Tier("disk", disk, 1)])):
        times = []
        for _ in range(args.repeats):
            info, _ = Checkpointer(comm, tier_list).restore(state)
            times.append(info.seconds)
        print(f"  recover from {name:18s}: {1e3 * np.median(times):8.1f} ms (step {info.step}; "
              "verify sha256 + read)")
    shutil.rmtree(mem, ignore_errors=True)
    if not args.disk:
        shutil.rmtree(disk, ignore_errors=True)
    return targets.exit_code(args.strict)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mb", type=float, default=100.0, help="size of the training state")
    ap.add_argument("--disk", help="disk checkpoint directory (default: a temporary one)")
    ap.add_argument("--strict", action="store_true", help="exit 1 when the target is missed")
    clock_flags(ap)
    args = ap.parse_args()
    use_clock(args, wall_only="it times disk writes and a background writer thread, which no rank's clock "
                              "prices (the virtual clock charges compute and messages)")
    print_machine()
    return run(body, ranks=1, args=args)[0]


if __name__ == "__main__":
    sys.exit(main())
