"""Lesson 16: the same GPT step, eager on JAX devices and compiled for the whole mesh.

    python -m minidist.lessons.tpu                       # every device JAX sees (laptop: 8 forced CPU ones)
    python -m minidist.lessons.tpu --dp 2 --tp 4         # a chosen mesh, e.g. a v5e-8's 8 TensorCores
    mpirun -n 2 python -m minidist.lessons.tpu           # multi-controller: 2 processes, 4 devices each

Runs on whatever devices JAX sees: without --dp/--tp the mesh takes all n of them
(``minidist.parallel.spmd.default_shape``: tp = 2 when n is even and >= 4, else 1; dp = n // tp; so 1 -> 1x1,
2 -> 2x1, 4 -> 2x2, 8 -> 4x2). Prints the device kind and the dp x tp mesh, then trains the
same GPT twice from the same weights on the same batches:

1. **eager minidist** on the JAX device transport: one rank per device, each rank a thread that
   dispatches one op at a time; tensor-parallel and data-parallel all-reduces are minidist's own
   algorithms on point-to-point messages, counted by the ledger;
2. **the compiled SPMD program** (``minidist.parallel.spmd``): the step written once with ``shard_map`` and
   compiled by ``jax.jit`` for every device at once; its collectives are counted in the HLO.

It checks that both reach the same loss and parameters (PASS, exit 1 on FAIL) and prints the step
times side by side, and the collectives each one ran.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections import Counter


def force_cpu_devices(env=os.environ, total: int = 8) -> int:
    """On a CPU, XLA shows one device per process unless ``XLA_FLAGS`` forces more. The lesson
    forces ``total`` (8) for the whole job: all 8 in one process, ``total // P`` in each of the P
    processes ``mpirun`` starts (at least 1), so one process and ``mpirun -n 2`` run the same 8-device
    mesh, split over the processes as a multi-host slice is split over hosts. Only when
    ``XLA_FLAGS`` does not already say (set it to choose: ``--xla_force_host_platform_device_count=1``
    gives one device per process); TPUs and GPUs ignore the flag. Returns the count per process."""
    flags = env.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in flags:
        return int(flags.split("xla_force_host_platform_device_count=")[1].split()[0])
    procs = int(env.get("PMI_SIZE") or env.get("OMPI_COMM_WORLD_SIZE") or 1)  # MPICH, Open MPI
    per = max(1, total // procs)
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={per}".strip()
    return per


force_cpu_devices()  # before JAX loads

import numpy as np  # noqa: E402

from minidist.accel import jax_cache  # noqa: E402
from minidist.accel.backend import configure_jax  # noqa: E402
from minidist.comm import measure, run, under_mpi, world  # noqa: E402
from minidist.comm.runner import install_abort_hook  # noqa: E402
from minidist.comm.transports.devices import jax_distributed_init  # noqa: E402
from minidist.lessons.cli import nonnegative_int, positive_float, positive_int  # noqa: E402
from minidist.lessons.progress import progress  # noqa: E402
from minidist.nn import GPTConfig  # noqa: E402
from minidist.nn.data import BatchLoader, TextDataset  # noqa: E402
from minidist.nn.serial import train_serial  # noqa: E402
from minidist.parallel.spmd import SPMDProgram, collective_counts, default_shape  # noqa: E402
from minidist.parallel.three_d import gather_full_state, max_state_diff, train_3d  # noqa: E402
from minidist.plan.hardware import TPU_V4, TPU_V5E, TPU_V5P  # noqa: E402


def make_batches(args):
    loader = BatchLoader(TextDataset.from_file(block_size=args.seq), batch_size=args.batch, seed=args.seed)
    return [loader.next_batch() for _ in range(args.steps)]


def eager(cfg, batches, args):
    """minidist on the device transport: (full state, losses, step seconds, ledger calls, devices)."""
    def body(comm):
        times = [time.perf_counter()]
        with measure(comm) as m, progress(total=len(batches), desc="eager", rank=comm.rank) as bar:
            res = train_3d(comm, cfg, batches, dp=args.dp, pp=1, tp=args.tp, lr=args.lr, optimizer="sgd",
                           on_step=lambda step, stats: (comm.backend.synchronize(),
                                                        times.append(time.perf_counter()), bar.update(1)))
        calls = Counter(c.name for c in m.calls)
        return gather_full_state(comm, res), res.losses, np.diff(times), calls, m.bytes_sent, str(comm.device)

    out = run(body, ranks=args.dp * args.tp, transport="jax")
    state, losses, times, calls, sent, _ = out[0]
    return state, losses, times, calls, sent, [o[5] for o in out]


def compiled(cfg, batches, args):
    """The SPMD program: (spmd, losses, step seconds, HLO collective counts)."""
    spmd = SPMDProgram(cfg, args.dp, args.tp, lr=args.lr, dp_reduce=args.dp_reduce)
    losses, times = [], []
    for x, y in progress(batches, desc="compiled"):
        t = time.perf_counter()
        losses.append(spmd.step(x, y))  # float(): waits for the device
        times.append(time.perf_counter() - t)
    return spmd, losses, times, collective_counts(spmd.compiled_text(*batches[0]))


def first_run_note(devices: int) -> str:
    """What the eager run's first step does before it prints anything: on JAX every op compiles once
    per shape and device, ~60-70 s for 8 CPU devices the first time; the cache makes it seconds."""
    root = jax_cache.cache_root()
    later = (f"later runs load them from the cache ({root})" if root else
             "MINIDIST_JAX_CACHE=0: no cache, so every run compiles them again")
    return (f"eager minidist: its step 0 compiles each op once per device ({devices} devices; about a "
            f"minute on a CPU the first time); {later}")


def print_mesh(mesh, processes: int) -> None:
    print(f"mesh ('dp', 'tp') = {mesh.devices.shape[0]} x {mesh.devices.shape[1]}"
          + (", device@process:" if processes > 1 else ":"))
    for row in mesh.devices:
        print("   " + "  ".join(f"{d.platform}:{d.id}" + (f"@{d.process_index}" if processes > 1 else "")
                                for d in row))


def multihost(cfg, batches, args, tol) -> int:
    """Several processes (``mpirun``, after ``jax_distributed_init``), JAX's multi-controller mode:
    every process runs this same program, and the compiled program's mesh spans every process's
    devices. The eager device transport is one process's threads, so here the program is checked
    against the serial twin (NumPy, computed in every process): the losses (replicated, every
    process reads them) and, in each process, the parameter shards on its own devices; the worst
    difference of any process decides. Process 0 prints; every process returns the same code."""
    import jax
    from jax.experimental import multihost_utils

    spmd, losses, times, hlo = compiled(cfg, batches, args)
    want_state, want = train_serial(cfg, batches, lr=args.lr)
    mine = [float(np.max(np.abs(np.array(losses) - np.array(want)))), spmd.shard_diff(want_state)]
    ldiff, diff = np.max(multihost_utils.process_allgather(np.array(mine)), axis=0)
    ok = diff <= tol and ldiff <= tol * 10
    print_mesh(spmd.mesh, jax.process_count())  # (process 0 prints: main silenced the others)
    print(f"compiled program over {spmd.mesh.devices.size} devices in {jax.process_count()} processes: "
          f"step ms {[round(t * 1e3, 1) for t in times]}, HLO collectives "
          f"{ {k: n for k, n in hlo.items() if n} }")
    print(f"{'PASS' if ok else 'FAIL'}: compiled program == serial twin after {args.steps} steps: "
          f"max parameter difference {diff:.2e} (each process its own shards), "
          f"max loss difference {ldiff:.2e} (tolerance {tol:g})")
    return 0 if ok else 1


def plot_runs(path, losses, spmd_losses, times, spmd_times, mesh: str) -> None:
    """Two panels, step by step: the loss of the eager ranks and of the compiled program (one curve on
    the other when they agree), and each step's wall time in ms on a log axis (step 0 compiles)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.8))
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    steps = np.arange(len(losses))
    left.plot(steps, losses, "o-", lw=2.5, color="tab:blue", label="eager minidist ranks")
    left.plot(steps, spmd_losses, "x--", color="tab:orange", label="compiled SPMD program")
    left.set(title=f"loss per step ({mesh})", xlabel="step", ylabel="loss (nats/token)")
    left.legend()
    right.plot(steps, np.array(times) * 1e3, "o-", color="tab:blue", label="eager minidist ranks")
    right.plot(steps, np.array(spmd_times) * 1e3, "x--", color="tab:orange", label="compiled SPMD program")
    right.set_yscale("log")
    for ax in (left, right):
        ax.set_xticks(steps)
    right.set(title="wall time per step (step 0 compiles)", xlabel="step", ylabel="ms (log)")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=positive_int, default=None,
                        help="data-parallel size (default: from the device count, see above; 1 if only --tp)")
    parser.add_argument("--tp", type=positive_int, default=None,
                        help="tensor-parallel size (default: from the device count; 1 if only --dp)")
    parser.add_argument("--steps", type=positive_int, default=4)
    parser.add_argument("--batch", type=positive_int, default=None,
                        help="rows per step (default: 4, or the next multiple of dp)")
    parser.add_argument("--seq", type=positive_int, default=16)
    parser.add_argument("--d-model", type=positive_int, default=32)
    parser.add_argument("--heads", type=positive_int, default=4)
    parser.add_argument("--layers", type=positive_int, default=2)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--lr", type=positive_float, default=0.1)
    parser.add_argument("--dp-reduce", choices=["ring", "psum"], default="ring",
                        help="the program's gradient all-reduce: minidist's ring (ppermute) or XLA's psum")
    parser.add_argument("--tol", type=positive_float, default=None,
                        help="largest parameter difference (default 1e-5 in float32, 1e-9 in float64)")
    parser.add_argument("--seed", type=nonnegative_int, default=0)
    parser.add_argument("--plot", metavar="FILE.png", help="draw both runs' loss and step time per step")
    args = parser.parse_args(argv)
    tol = args.tol or (1e-5 if args.dtype == "float32" else 1e-9)

    jax = configure_jax()  # float64 stays float64; full float32 matmuls: not bf16 passes, not TF32
    if under_mpi():  # one process per host: agree on the coordinator over MPI, then JAX sees all hosts
        install_abort_hook()  # a process that raises ends the job: the others would wait in a collective
        jax_distributed_init(world())
    devices = jax.devices()
    if args.dp is None and args.tp is None:
        args.dp, args.tp = default_shape(len(devices))
    args.dp, args.tp = args.dp or 1, args.tp or 1
    if args.dp * args.tp > len(devices):
        parser.error(f"--dp {args.dp} x --tp {args.tp} = {args.dp * args.tp} devices, "
                     f"JAX sees {len(devices)}")
    if args.dp * args.tp % jax.process_count():
        parser.error(f"--dp {args.dp} x --tp {args.tp} = {args.dp * args.tp} devices do not split "
                     f"over {jax.process_count()} processes")
    args.batch = args.batch or args.dp * math.ceil(4 / args.dp)
    if args.batch % args.dp:
        parser.error(f"argument --batch: {args.batch} rows do not split over --dp {args.dp}")
    if args.heads % args.tp or args.d_model % args.heads:
        parser.error(f"--heads {args.heads} must be a multiple of --tp {args.tp} and divide --d-model")
    if jax.process_index():  # multi-controller: every process runs all of this, process 0 prints
        sys.stdout = open(os.devnull, "w")
    print(f"JAX {jax.__version__}: {len(devices)} devices, platform {devices[0].platform}, "
          f"kind {devices[0].device_kind!r}, {jax.process_count()} process(es)")
    batches = make_batches(args)
    vocab = 256  # bytes (minidist.nn.data.ByteTokenizer): a multiple of 128, what a TPU's MXU wants
    cfg = GPTConfig(vocab_size=vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                    d_model=args.d_model, dtype=args.dtype)
    print(f"GPT: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, vocab {vocab}, "
          f"batch {args.batch} x {args.seq} tokens, {args.dtype}, SGD lr {args.lr}, {args.steps} steps\n")

    if jax.process_count() > 1:
        return multihost(cfg, batches, args, tol)
    spmd, spmd_losses, spmd_times, hlo = compiled(cfg, batches, args)
    print_mesh(spmd.mesh, 1)
    print(first_run_note(args.dp * args.tp), flush=True)  # step 0 may be a silent minute: say why first
    state, losses, times, calls, sent, bound = eager(cfg, batches, args)
    print("eager ranks bound to: " + ", ".join(f"rank {r} -> {d}" for r, d in enumerate(bound)) + "\n")

    print(f"{'step':>4}  {'eager loss':>12}  {'spmd loss':>12}  {'eager ms':>10}  {'spmd ms':>10}")
    for i in range(args.steps):
        print(f"{i:>4}  {losses[i]:>12.6f}  {spmd_losses[i]:>12.6f}  {times[i] * 1e3:>10.1f}  "
              f"{spmd_times[i] * 1e3:>10.1f}")
    if args.steps > 1:
        e, t = statistics.median(times[1:]), statistics.median(spmd_times[1:])
        print(f"median after the first (compiling) step: eager {e * 1e3:.1f} ms, compiled {t * 1e3:.1f} ms "
              f"({e / t:.1f}x)")

    print("\ncollectives per run -- eager minidist, rank 0's ledger (calls over all steps, "
          f"{sent} bytes sent):")
    for name, n in sorted(calls.items()):
        print(f"   {name:<28} {n:>4} calls ({n / args.steps:g} per step)")
    if not calls:
        print("   none: one rank has no one to talk to")
    print("compiled program, one step's HLO (what XLA emitted):")
    for name, n in hlo.items():
        if n:
            print(f"   {name:<28} {n:>4}")

    print("\nwhere these collectives would run (minidist.plan.hardware, sources there), GB/s per chip:")
    print(f"   {'chip':<9} {'HBM':>7} {'ICI ring':>9} {'DCN':>6}")
    for hw in (TPU_V4, TPU_V5E, TPU_V5P):
        print(f"   {hw.name:<9} {hw.hbm_bandwidth / 1e9:>7.0f} {hw.intra.bandwidth / 1e9:>9.0f} "
              f"{hw.inter.bandwidth / 1e9:>6.1f}")

    if args.plot:
        plot_runs(args.plot, losses, spmd_losses, times, spmd_times, f"dp {args.dp} x tp {args.tp}")
        print(f"\nplot drawn to {args.plot}")

    diff = max_state_diff(spmd.state(), state)
    ldiff = float(np.max(np.abs(np.array(losses) - np.array(spmd_losses))))
    ok = diff <= tol and ldiff <= tol * 10
    print(f"\n{'PASS' if ok else 'FAIL'}: eager minidist == compiled program after {args.steps} steps: "
          f"max parameter difference {diff:.2e}, max loss difference {ldiff:.2e} (tolerance {tol:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    from minidist.lessons.cli import run_lesson

    run_lesson(main)
