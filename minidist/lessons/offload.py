"""Lesson 8: offload -- AdamW's state on disk (numpy.memmap), streamed in and out by a helper thread.

    python -m minidist.lessons.offload --ranks 2
    mpirun -n 2 python -m minidist.lessons.offload --offload-dir /tmp

Every rank trains its own copy of a GPT three ways: AdamW in memory (the serial twin), AdamW with
m and v in host arrays ("host": what a GPU run offloads to), and AdamW with m and v in memmap files
("disk", the NVMe offload of ZeRO-Infinity). It checks the parameters are bit-identical, prints the
optimizer-state bytes kept in compute memory beside 8·Ψ (fp32 m and v), the step time and the
overhead, and a timeline of one optimizer step: the helper thread loads shard n+1's state and
writes shard n-1's back while the step's thread updates the parameters of shard n.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

from minidist import trace
from minidist.lessons.cli import (
    finish,
    launch,
    lesson_parser,
    positive_float,
    positive_int,
    rprint,
    worst,
)
from minidist.lessons.progress import progress
from minidist.nn.footprint import MemoryAccountant
from minidist.nn.gpt import GPT, GPTConfig
from minidist.nn.optim import AdamW
from minidist.parallel.memory.offload import OffloadedAdamW
from minidist.trace import ascii_timeline_from_events, plot_timeline


def run_training(cfg, opt_factory, data, comm, tracer=None, name=""):
    """Train ``len(data)`` steps; returns (model, optimizer, median step seconds, median opt.step seconds)."""
    model = GPT(cfg)
    opt = opt_factory(model.parameters())
    steps, opt_steps = [], []
    for s, idx in enumerate(progress(data, desc=name or "train", rank=comm.rank)):
        comm.barrier()
        t0 = trace.clock.now()  # the rank's clock: virtual under --clock virtual, else wall
        loss = model.loss(idx, idx)
        loss.backward()
        t1 = trace.clock.now()
        opt.step()
        opt.zero_grad()
        t2 = trace.clock.now()
        if tracer is not None:
            tracer.add(f"{name} step", "compute", tracer.now() - (t2 - t0), tracer.now(), step=s)
        if s:  # the first step creates the state: a warm-up
            steps.append(t2 - t0)
            opt_steps.append(t2 - t1)
    return model, opt, float(np.median(steps)), float(np.median(opt_steps))


def rank_main(comm, args):
    cfg = GPTConfig(vocab_size=64, block_size=args.seq, n_layer=args.layers, n_head=4, d_model=args.dim,
                    seed=args.seed)
    rng = np.random.default_rng(args.seed + comm.rank)
    data = [rng.integers(0, 64, (args.batch, args.seq)) for _ in range(args.steps)]
    folder = args.offload_dir or tempfile.gettempdir()
    rprint(comm, __doc__.split("\n\n")[2].strip() + "\n")
    tracer = trace.current()
    kw = dict(lr=args.lr, weight_decay=0.01)
    ref, ref_opt, t_ref, o_ref = run_training(cfg, lambda ps: AdamW(ps, **kw), data, comm, tracer, "memory")
    psi = ref.num_parameters()
    rprint(comm, f"GPT {cfg.n_layer} layers d={cfg.d_model}: Ψ = {psi:,} parameters, {len(ref.parameters())} "
                 f"tensors; {args.steps} steps of b={args.batch}, T={args.seq} on each of {comm.size} ranks "
                 f"({comm.transport}); offload folder {folder}\n")
    rprint(comm, "optimizer state in compute memory (MemoryAccountant.report) between steps, and at most "
                 "during a step:")
    rprint(comm, f"{'optimizer':<14} {'max|diff|':>10} {'check':>5} {'between':>10} {'during':>10} "
                 f"{'formula':>12} {'step ms':>8} {'ratio':>6} {'opt.step ms':>11}")
    held = MemoryAccountant().report(ref, ref_opt)["optimizer_state"]
    eight_psi = f"8Ψ = {8 * psi:,}"
    rprint(comm, f"{'AdamW (twin)':<14} {0.0:>10.1e} {'-':>5} {held:>10,} {held:>10,} {eight_psi:>12} "
                 f"{t_ref * 1e3:>8.1f} {1.0:>5.2f}x {o_ref * 1e3:>11.2f}")
    events, ok, explain = None, True, []
    for where in ("host", "disk"):
        def factory(ps, where=where):
            return OffloadedAdamW(ps, folder, where=where, shard_bytes=args.shard_kib << 10, **kw)
        model, opt, t, o = run_training(cfg, factory, data, comm, tracer, where)
        diff = worst(float(np.abs(a.numpy() - b.numpy()).max())  # on the host: no program per shape on JAX
                   for a, b in zip(ref.parameters(), model.parameters()))
        if where == "disk":  # one more step, recorded, for the timeline
            opt.events = []
            model.loss(data[0], data[0]).backward()
            opt.step()
            events = opt.events
        largest = max(sum(2 * model.parameters()[i].data.nbytes for i in sh) for sh in opt.shards)
        nshards = len(opt.shards)
        ts = comm.allgather_obj(t)
        held = MemoryAccountant().report(model, opt)["optimizer_state"]
        ok &= diff == 0
        rprint(comm, f"{'offload ' + where:<14} {diff:>10.1e} {'PASS' if diff == 0 else 'FAIL':>5} "
                     f"{held:>10,} {opt.resident_peak:>10,} {'≤ 3 shards':>12} {np.median(ts) * 1e3:>8.1f} "
                     f"{np.median(ts) / t_ref:>5.2f}x {o * 1e3:>11.2f}")
        opt.close()
        explain.append((where, o, float(np.median(ts))))
    share = o_ref / t_ref  # the optimizer step's part of a whole in-memory step
    rprint(comm, f"\nwhy a much slower optimizer step barely shows in the whole step: the optimizer step is "
                 f"{share:.0%} of an\nin-memory step ({o_ref * 1e3:.1f} of {t_ref * 1e3:.1f} ms); forward, "
                 "backward and the all-reduce are unchanged, so an optimizer step\nk times slower predicts a "
                 "whole step of 1 + share·(k-1) -- less where one rank's step waits on its helper\n"
                 "thread while another rank computes (timings on a shared machine move by tens of percent):")
    for where, o, t in explain:
        k = o / o_ref
        rprint(comm, f"  {where}: optimizer step {k:.1f}x -> predicted whole step "
                     f"{1 + share * (k - 1):.2f}x, measured {t / t_ref:.2f}x")
    rprint(comm, f"\n({nshards} shards of about {args.shard_kib} KiB of m+v (a bigger tensor is a shard "
                 f"alone); the largest is {largest:,} bytes;\n at most three are resident: being updated, "
                 "prefetched, written back)")
    rprint(comm, "\none disk-offloaded optimizer step on rank 0: L = load m,v from the memmap, "
                 "U = adamw_update, W = write back (digits: shard index)")
    if comm.rank == 0 and events:
        t0 = min(e["t0"] for e in events)
        for e in events:
            e["t0"], e["t1"] = e["t0"] - t0, e["t1"] - t0
        names = {0: "step  ", 1: "helper"}
        text = ascii_timeline_from_events(events, width=100, label="thread")
        for r, n in names.items():
            text = text.replace(f"thread {r}", n)
        print(text, flush=True)
        if args.plot:
            plot_timeline(args.plot, events, title="disk offload: the step thread and the helper thread",
                          labels={0: "step thread", 1: "helper thread"}, ms=True)
            print(f"wrote {args.plot}", flush=True)
    return finish(comm, ok)


def main(argv=None):
    parser = lesson_parser(__doc__, ranks=2)
    parser.add_argument("--layers", type=positive_int, default=2)
    parser.add_argument("--dim", type=positive_int, default=128, help="d_model, a multiple of the 4 heads")
    parser.add_argument("--seq", type=positive_int, default=32)
    parser.add_argument("--batch", type=positive_int, default=4)
    parser.add_argument("--steps", type=positive_int, default=6,
                        help="training steps (>= 2: the first, which creates the state, is not timed)")
    parser.add_argument("--lr", type=positive_float, default=1e-3)
    parser.add_argument("--shard-kib", type=positive_int, default=256, help="m+v bytes per shard, in KiB")
    parser.add_argument("--offload-dir", default=None,
                        help="an existing, writable folder (default: the temp dir)")
    args = parser.parse_args(argv)
    if args.dim % 4:
        parser.error(f"argument --dim: must be a multiple of the 4 attention heads, got {args.dim}")
    if args.steps < 2:
        parser.error(f"argument --steps: must be >= 2 (step 0 creates the state and is not timed), "
                     f"got {args.steps}")
    if args.offload_dir is not None and not (os.path.isdir(args.offload_dir)
                                             and os.access(args.offload_dir, os.W_OK)):
        parser.error(f"argument --offload-dir: {args.offload_dir!r} is not an existing, writable folder")
    launch(rank_main, args)


if __name__ == "__main__":
    from minidist.lessons.cli import run_lesson

    run_lesson(main)
