"""Lesson 6: activation recomputation -- trade one extra forward for most of the activation memory.

    python -m minidist.lessons.checkpointing --ranks 2
    mpirun -n 2 python -m minidist.lessons.checkpointing

Every rank trains a GPT on its shard of the batch, data parallel (gradients averaged by all-reduces
launched from each parameter's post-accumulate hook, as DDP does -- they still fire from inside
the recomputation). For each policy -- none, full (every block), sqrt(n) segments (Chen et al.),
selective (attention core only) -- it prints the measured peak bytes of saved activations beside
the formula, the compute time of a step beside 1 + (what it recomputes)/(F + B), and checks the gradients
against the serial twin (the whole batch on one rank, no recomputation). Then the live activation
bytes during one backward, as a sparkline. Under ``--clock virtual --device NAME`` the times are the
device model's and the time ratios are checked against the formula.
"""

from __future__ import annotations

import math
import time

import numpy as np

from minidist import trace
from minidist.autograd import ops
from minidist.autograd import random as mrandom
from minidist.autograd.tensor import Tensor
from minidist.comm import all_reduce
from minidist.lessons.cli import (
    finish,
    launch,
    lesson_parser,
    positive_int,
    rprint,
    worst,
)
from minidist.nn.footprint import MemoryAccountant
from minidist.nn.gpt import GPT, GPTConfig
from minidist.parallel.memory import recompute
from minidist.parallel.memory.recompute import (
    apply_recompute,
    block_activation_elements,
    predicted_peak_activation_bytes,
    segment_size,
)
from minidist.plan import estimates
from minidist.trace.spans import now

POLICIES = tuple(q for q in recompute.POLICIES if q != "every_k")  # every_k needs a k: sqrt picks one
TIME_TOL = 0.02  # under a device model: each policy's time ratio within 2% of its formula
BARS = " ▁▂▃▄▅▆▇█"


PLANNER_POLICY = {"full": "full", "selective": "selective"}  # the planner has no sqrt segments: "none"


def sparkline(values, top) -> str:
    return "".join(BARS[min(8, round(8 * v / top))] for v in values)


def window_peak(acct, samples):
    """Append the peak live bytes since the last sample, and start a new window."""
    samples.append(acct.peak_activation_bytes)
    acct.reset_peak()


def step(model, acct, idx, samples=None):
    """One forward + backward on this rank's shard, its saved activations counted by ``acct``."""
    with acct.track_activations(model):
        loss = model.loss(idx, idx)
        if samples is not None:
            window_peak(acct, samples)
        loss.backward()
    return loss


def time_step(model, comm, idx, repeats, tracer, policy):
    """Median seconds of this rank's forward + backward (a model without the all-reduce hooks).

    On the virtual clock, the rank's (``trace.clock``: CPU time, or a device model's); else CPU time of
    this thread (``time.thread_time``), not wall time: it does not count the time other ranks or
    programs hold the CPU, so the ratio between policies is stable on a busy machine."""
    clock = now if comm.clock is not None else time.thread_time
    times = []
    for r in range(repeats + 1):
        model.zero_grad()
        comm.barrier()
        t0 = clock()
        if tracer is not None:
            with tracer.span(policy[0].upper(), "compute", policy=policy):
                model.loss(idx, idx).backward()
        else:
            model.loss(idx, idx).backward()
        if r:  # the first is a warm-up
            times.append(clock() - t0)
    return float(np.median(times))


def forward_costs(cfg, batch, comm) -> tuple:
    """(one block's forward, the attention core's forward) in seconds, timed as ``time_step`` times:
    what full and selective recomputation run once more in backward."""
    clock = now if comm.clock is not None else time.thread_time
    block = GPT(cfg)[1]
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((batch, cfg.block_size, cfg.d_model)).astype(np.float32))
    qkv = Tensor(rng.standard_normal((batch, cfg.block_size, 3 * cfg.d_model)).astype(np.float32))
    out = []
    for fn in (lambda: block(x), lambda: ops.packed_attention(qkv, cfg.n_head)):
        fn()  # warm-up
        t0 = clock()
        fn()
        out.append(clock() - t0)
    return tuple(out)


def rank_main(comm, args):
    cfg = GPTConfig(vocab_size=64, block_size=args.seq, n_layer=args.layers, n_head=4, d_model=args.dim,
                    dropout=0.1, seed=args.seed)
    p = comm.size
    data = np.random.default_rng(args.seed).integers(0, 64, (args.batch * p, args.seq))
    shard = data[comm.rank * args.batch:(comm.rank + 1) * args.batch]
    rprint(comm, __doc__.split("\n\n")[2].strip() + "\n")
    rprint(comm, f"GPT: {cfg.n_layer} blocks, d_model {cfg.d_model}, {cfg.n_head} heads, "
                 f"dropout {cfg.dropout}; per rank b={args.batch}, T={args.seq}; "
                 f"{p} ranks ({comm.transport})")
    b, t, c, h = args.batch, args.seq, cfg.d_model, cfg.n_head
    a = sum(block_activation_elements(b, t, c, h, dropout=cfg.dropout > 0).values())
    rprint(comm, f"one block saves A = 22·BTC + 2·BT + B·H·T² = {a:,} elements "
                 f"(with dropout); a segment input is BTC = {b*t*c:,}\n")

    # the serial twin: the whole batch on one model, no recomputation, same dropout stream per shard
    twin = None
    if comm.rank == 0:
        grads = []
        for r in range(p):
            m = GPT(cfg)
            mrandom.manual_seed(args.seed + r)
            rows = data[r * args.batch:(r + 1) * args.batch]
            m.loss(rows, rows).backward()
            grads.append([q.backend.to_host(q.grad) for q in m.parameters()])
        twin = [sum(gs) / p for gs in zip(*grads)]  # on the host: no program per shape on JAX

    clock = comm.clock
    exact = clock is not None and clock.device is not None  # the device model's times: checked
    unit = "virtual" if clock is not None else "cpu"
    f_block, f_core = forward_costs(cfg, args.batch, comm)
    u, un = (1e6, "us") if f_block < 1e-4 else (1e3, "ms")
    rprint(comm, f"{'policy':<10} {'peak act bytes':>15} {'formula':>12} {'vs none':>8} {f'{unit} {un}':>10} "
                 f"{'vs none':>8} {'formula':>8} {'max|diff| vs twin':>18} {'planner ms':>12}")
    base_mem = base_t = None
    passed = True
    curves, rows = {}, []
    tracer = trace.current()
    for policy in POLICIES:
        model = apply_recompute(GPT(cfg), policy)
        for q in model.parameters():
            q.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", all_reduce(comm, q.grad) / p))
        acct = MemoryAccountant()
        samples = []
        for q in model.parameters():  # sample the live bytes each time a parameter's grad is ready
            q.register_post_accumulate_grad_hook(lambda q, s=samples, a=acct: window_peak(a, s))
        mrandom.manual_seed(args.seed + comm.rank)
        step(model, acct, shard, samples)
        got = [q.backend.to_host(q.grad) for q in model.parameters()]  # compared on the host
        sec = time_step(apply_recompute(GPT(cfg), policy), comm, shard, args.repeats, tracer, policy)
        peak = max(comm.allgather_obj(max(samples)))  # the largest window peak is the peak
        formula = predicted_peak_activation_bytes(cfg, args.batch, args.seq, policy)
        diff = worst(np.abs(a - w).max() for a, w in zip(got, twin)) if twin is not None else 0.0
        base_mem, base_t = base_mem or peak, base_t or sec
        extra = {"none": 0.0, "selective": f_core}.get(policy, f_block)  # forward run again, per block
        want_t = 1 + cfg.n_layer * extra / base_t
        curves[policy] = samples
        rows.append((policy, peak, formula, sec))
        passed &= diff <= 1e-6 and (not exact or abs(sec / base_t - want_t) <= TIME_TOL * want_t)
        ok = "PASS" if diff <= 1e-6 else "FAIL"
        pred = estimates.step_prediction(cfg.n_layer, cfg.d_model, cfg.n_head, cfg.vocab_size, args.seq,
                                         args.batch * p, dp=p, checkpoint=PLANNER_POLICY.get(policy, "none"),
                                         transport=comm.transport if comm.transport == "mpi" else "threads")
        pred_ms = "-" if pred is None else f"{pred * 1e3:.1f}"
        rprint(comm, f"{policy:<10} {peak:>15,} {formula:>12,} {base_mem / peak:>7.2f}x {sec * u:>10.3f} "
                     f"{sec / base_t:>7.3f}x {want_t:>7.3f}x {diff:>13.1e} {ok} {pred_ms:>12}")
    rprint(comm, "(planner ms: the wall-clock step the planner predicts from this machine's calibration, "
                 "chapter 0 -- all ranks\n sharing the cores, so compare its ratio full/none with the "
                 "cpu-time ratio, not its milliseconds; it has no sqrt segments)")
    k = segment_size("sqrt", cfg.n_layer)
    k_star = math.sqrt(cfg.n_layer * b * t * c / a)  # d/dk [(L/k)·BTC + k·A] = 0
    best = min(range(1, cfg.n_layer + 1), key=lambda j: -(-cfg.n_layer // j) * b * t * c + j * a)
    rprint(comm, f"\nthe best segment: (L/k)·BTC + k·A is least at k* = sqrt(L·BTC/A) = sqrt({cfg.n_layer}·"
                 f"{b * t * c:,}/{a:,}) = {k_star:.2f}, not sqrt(L) = {math.sqrt(cfg.n_layer):.2f}: "
                 f"the best whole k is {best}" + (" -- full recomputation, which is why it beats sqrt here"
                                                  if best == 1 else ""))
    rprint(comm, f"\nformulas: none E + L·A + Head; full max(E + L·BTC + Head, E + L·BTC + A); "
                 f"sqrt: segments of k = round(√{cfg.n_layer}) = {k} blocks,\n  E + (L/k)·BTC + k·A; "
                 "selective: the B·H·T² attention probabilities are not kept.")
    full_t, sel_t = 1 + cfg.n_layer * f_block / base_t, 1 + cfg.n_layer * f_core / base_t
    verdict = (f"measured within {TIME_TOL:.0%} on the device model: {'PASS' if passed else 'FAIL'}" if exact
               else f"{unit} time: shown, not checked (--clock virtual --device times it exactly)")
    rprint(comm, f"time: a step without recomputation F + B = {base_t * u:.3f} {un}; full and sqrt run each "
               f"block's forward again ({f_block * u:.3f} {un}), selective each attention core's "
               f"({f_core * u:.3f} {un}):\n  1 + L·block/(F + B) = {full_t:.3f}x, 1 + L·core/(F + B) = "
               f"{sel_t:.3f}x (if B = 2F, as FLOPs go: full 1.33x); {verdict}")
    rprint(comm, "(max|diff|: float32 grads of an all-reduced average vs the serial average -- equal up to "
                 "rounding of the sum.)")
    rprint(comm, "\nsaved-activation bytes over one step: the end of forward, then the peak between one "
                 "parameter gradient\nand the next in backward (the teeth of full and sqrt: each "
                 "block or segment recomputed, then freed):")
    top = max(max(v) for v in curves.values())
    for policy, v in curves.items():
        rprint(comm, f"{policy:<10}|{sparkline(v, top)}|")
    if args.plot and comm.rank == 0:
        plot(args.plot, rows, curves)
        print(f"wrote {args.plot}")
    return finish(comm, passed)


def plot(path, rows, curves):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    a1, a2 = fig.subplots(1, 2)
    names = [r[0] for r in rows]
    x = np.arange(len(rows))
    a1.bar(x - 0.2, [r[1] / 2**20 for r in rows], 0.4, label="measured")
    a1.bar(x + 0.2, [r[2] / 2**20 for r in rows], 0.4, label="formula")
    a1.set_xticks(x, names)
    a1.set_ylabel("peak saved activations (MiB)")
    a1.set_title("peak activation memory per policy")
    a1.legend()
    for name, v in curves.items():
        a2.plot(np.array(v) / 2**20, label=name)
    a2.set_xlabel("backward progress (parameter grads ready)")
    a2.set_ylabel("live activations (MiB)")
    a2.set_title("activations alive as backward runs")
    a2.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None):
    parser = lesson_parser(__doc__, ranks=2)
    parser.add_argument("--layers", type=positive_int, default=8)
    parser.add_argument("--dim", type=positive_int, default=64, help="d_model, a multiple of the 4 heads")
    parser.add_argument("--seq", type=positive_int, default=64)
    parser.add_argument("--batch", type=positive_int, default=4, help="sequences per rank")
    parser.add_argument("--repeats", type=positive_int, default=7)
    args = parser.parse_args(argv)
    if args.dim % 4:
        parser.error(f"argument --dim: must be a multiple of the 4 attention heads, got {args.dim}")
    launch(rank_main, args)


if __name__ == "__main__":
    from minidist.lessons.cli import run_lesson

    run_lesson(main)
