"""Lesson 7: mixed precision -- bf16 and fp16 compute, fp32 master weights, dynamic loss scaling.

    python -m minidist.lessons.mixed_precision --ranks 2
    mpirun -n 2 python -m minidist.lessons.mixed_precision

Data-parallel ranks train the same GPT in fp32, bf16 and fp16 (low-precision gradients all-reduced in
low precision). It prints: bf16 rounding checked against ml_dtypes; the three loss curves beside
the fp32 serial twin with the stated tolerance; the all-reduce bytes from the ledger beside
2(p-1)/p·Ψ·bytes; why fp16 needs the loss scale (gradients that underflow to zero); and a loss-scale
timeline where an inf injected on one rank makes every rank skip the step and halve the scale.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from minidist.accel.backend import to_host
from minidist.comm import measure
from minidist.comm.cost import all_reduce_bytes_sent
from minidist.lessons.cli import (
    finish,
    launch,
    lesson_parser,
    positive_float,
    positive_int,
    rprint,
    worst,
)
from minidist.nn.gpt import GPT, GPTConfig
from minidist.nn.optim import AdamW
from minidist.nn.serial import train_serial
from minidist.parallel.memory.precision import DynamicLossScaler, MixedPrecision, round_to_bf16
from minidist.plan import estimates

TOL = 1e-2  # stated: losses within 1% (relative) of fp32 over the run


def batches(cfg, p, b, steps, seed):
    """The global batch of every step (the same on every rank; rank r takes rows r·b .. r·b+b)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, cfg.vocab_size, (p * b, cfg.block_size)) for _ in range(steps)]


def train(comm, cfg, dtype, data, b, lr, inject=(), growth_interval=2000):
    """Data-parallel training; returns per-step (loss averaged over ranks, scale, stepped per rank)."""
    scaler = DynamicLossScaler(growth_interval=growth_interval) if dtype == "fp16" else None
    mp = MixedPrecision(GPT(cfg), dtype, groups=[comm], scaler=scaler)
    opt = AdamW(mp.master_params, lr=lr)
    log, grad_bytes = [], 0
    for step, batch in enumerate(data):
        idx = batch[comm.rank * b:(comm.rank + 1) * b]
        loss = mp.loss(idx, idx)
        mp.backward(loss)
        with measure(comm) as m:
            mp.all_reduce_grads(comm)
        grad_bytes = m.bytes_sent
        if (step, comm.rank) in inject:  # a gradient overflows on this rank only
            be = mp.params[1].backend
            g = np.array(be.to_host(mp.params[1].grad))
            g.flat[0] = np.inf
            mp.params[1].grad = be.from_host(g)
        scale = mp.scale
        stepped = mp.step(opt)
        log.append((float(np.mean(comm.allgather_obj(loss.item()))), scale, comm.allgather_obj(stepped)))
    return log, grad_bytes, mp


def serial_fp32(cfg, data, lr):
    """The serial twin: one fp32 GPT on the whole global batches (AdamW as the runs); its losses."""
    return train_serial(cfg, [(b, b) for b in data], lr=lr, optimizer="adamw", weight_decay=0.01)[1]


def fp16_representation(cfg, idx):
    """Of the nonzero fp32 gradient elements, the share fp16 flushes to 0 or keeps only as a subnormal
    (|g·S| < 2^-14, fewer than 10 significant bits) at loss scale S = 1 and S = 2^16."""
    model = GPT(cfg)
    model.loss(idx, idx).backward()
    g = np.abs(np.concatenate([to_host(q.grad).ravel() for q in model.parameters()]))
    g = g[g > 0]
    out = {}
    for scale in (1.0, 2.0 ** 16):
        h = np.abs((g * scale).astype(np.float16))
        out[scale] = (float(np.mean(h == 0)), float(np.mean(h < 2.0 ** -14)), float(np.mean(np.isinf(h))))
    return out


def rank_main(comm, args):
    p, b = comm.size, args.batch
    cfg = GPTConfig(vocab_size=64, block_size=args.seq, n_layer=args.layers, n_head=4, d_model=args.dim,
                    seed=args.seed)
    rprint(comm, __doc__.split("\n\n")[2].strip() + "\n")

    x = np.random.default_rng(args.seed).standard_normal(1 << 20).astype(np.float32) * 100
    bad = int(np.sum(round_to_bf16(x).view(np.uint16) != x.astype(ml_dtypes.bfloat16).view(np.uint16)))
    ok = bad == 0
    rprint(comm, "bf16 = the top 16 bits of fp32, rounded to nearest even: round_to_bf16 vs ml_dtypes "
                 f"on 2^20 values: {bad} mismatches {'PASS' if bad == 0 else 'FAIL'}")
    with np.errstate(over="ignore"):  # 70000 > 65504, the largest fp16: inf, on purpose
        for v in (1 / 3, np.pi, 70000.0, 1e-6):
            rprint(comm, f"  {v:<12.7g} bf16 {float(round_to_bf16(np.float32(v))[()]):<12.7g} "
                         f"fp16 {float(np.float16(v)):<12.7g}")

    data = batches(cfg, p, b, args.steps, args.seed)
    twin = serial_fp32(cfg, data, args.lr) if comm.rank == 0 else None
    runs = {dt: train(comm, cfg, dt, data, b, args.lr) for dt in ("fp32", "bf16", "fp16")}
    rprint(comm, f"\n{p} ranks x {b} sequences of {cfg.block_size} tokens, GPT {cfg.n_layer} layers "
                 f"d={cfg.d_model}, AdamW lr {args.lr}; loss per step:")
    rprint(comm, f"{'step':>4} {'serial fp32':>12} {'fp32':>9} {'bf16':>9} {'fp16':>9}")
    for s in range(args.steps):
        cols = " ".join(f"{runs[d][0][s][0]:>9.5f}" for d in runs)
        rprint(comm, f"{s:>4} {twin[s] if twin else 0:>12.5f} {cols}")
    if comm.rank == 0:
        for d in runs:
            rel = worst(abs(r[0] - t) / abs(t) for r, t in zip(runs[d][0], twin))
            ok &= rel <= TOL
            print(f"  {d}: max relative loss difference vs serial fp32 {rel:.2e} "
                  f"(tolerance {TOL:g}) {'PASS' if rel <= TOL else 'FAIL'}", flush=True)

    psi = sum(q.size for q in runs["fp32"][2].params)
    rprint(comm, f"\ngradient all-reduce per step (ledger, one rank) vs 2(p-1)/p·Ψ·bytes, "
                 f"Ψ = {psi:,} parameters:")
    for d, nbytes in (("fp32", 4), ("bf16", 2), ("fp16", 2)):
        want = all_reduce_bytes_sent("ring", psi * nbytes, p, comm.rank)
        rprint(comm, f"  {d}: {runs[d][1]:>10,} bytes  formula {want:>12,.0f}")
    rprint(comm, "memory per parameter: fp32 training 4 (weights) + 4 (grads) + 8 (Adam) = 16 bytes; "
                 "mixed 2 + 2 + 4 (fp32 master) + 8 = 16 bytes --\n  the same, but activations (and what is "
                 "sent) are halved; ZeRO then shards the 12 bytes of master + Adam state.")
    mem = {k: estimates.training_memory(psi, k)["total"] for k in ("fp32", "mixed")}
    z1 = estimates.training_memory(psi, "mixed", zero_stage=1, dp=p)["total"]
    rprint(comm, f"  for this Ψ (chapter 0, estimates.training_memory): fp32 {mem['fp32']:,.0f} bytes, mixed "
                 f"{mem['mixed']:,.0f}, mixed + ZeRO-1 over {p} ranks {z1:,.0f} per rank")

    if comm.rank == 0:
        rep = fp16_representation(cfg, data[0][:b])
        print("\nwhy fp16 needs a loss scale S (fp16: 5 exponent bits, normal numbers >= 2^-14 = 6.1e-5):",
              flush=True)
        for scale, (zero, sub, inf) in rep.items():
            print(f"  S = {scale:>7.0f}: of the nonzero fp32 gradients {zero:6.1%} become 0, {sub:6.1%} are "
                  f"subnormal or 0, {inf:.1%} overflow", flush=True)

    inject = {(3, p - 1), (6, 0)}
    log, _, _ = train(comm, cfg, "fp16", data, b, args.lr, inject=inject, growth_interval=2)
    rprint(comm, f"\nloss-scale timeline, fp16, growth_interval 2; inf injected at step 3 on rank {p - 1} "
                 "and at step 6 on rank 0\n(S = stepped, - = skipped: every rank agrees because the flag is "
                 "all-reduced):")
    rprint(comm, f"{'step':>4} {'scale':>8}  " + " ".join(f"r{r}" for r in range(p)))
    for s, (_, scale, stepped) in enumerate(log):
        rprint(comm, f"{s:>4} {scale:>8.0f}  " + "  ".join("S" if x else "-" for x in stepped))
    if args.plot and comm.rank == 0:
        plot(args.plot, twin, runs, log)
        print(f"wrote {args.plot}")
    return finish(comm, ok)


STYLES = {"fp32": ("C0", "-", "o"), "bf16": ("C1", "--", "s"), "fp16": ("C2", ":", "^")}


def plot(path, twin, runs, log):
    """Three panels: the losses (they overlap: that is the point), each run's loss minus the fp32 twin's
    (where the formats differ), and the fp16 loss scale of the injected-overflow run."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(14, 4.2))
    FigureCanvasAgg(fig)
    a1, a2, a3 = fig.subplots(1, 3)
    steps = np.arange(len(twin))
    a1.plot(steps, twin, "k-", lw=4, alpha=0.25, label="serial fp32 (the twin)")
    for d, r in runs.items():
        color, ls, marker = STYLES[d]
        loss = np.array([x[0] for x in r[0]])
        a1.plot(steps, loss, color=color, ls=ls, marker=marker, markersize=4, label=f"{d}, data parallel")
        a2.plot(steps, loss - np.asarray(twin), color=color, ls=ls, marker=marker, markersize=4, label=d)
    a1.set(xlabel="training step", ylabel="training loss, nats/token",
           title="loss per step, fp32 / bf16 / fp16\n(they lie on top of each other)")
    a1.legend(fontsize=8)
    a2.axhline(0, color="k", lw=0.8)
    a2.set(xlabel="training step", ylabel="loss − serial fp32 loss, nats/token",
           title="difference from the serial fp32 twin\n(what each format's rounding changes)")
    a2.legend(fontsize=8)
    scale = [x[1] for x in log]
    a3.step(range(len(log)), scale, where="post", color="C2")
    skipped = [s for s, x in enumerate(log) if not all(x[2])]
    a3.plot(skipped, [scale[s] for s in skipped], "rx", markersize=10,
            label="inf injected: step skipped, S halves")
    a3.set_yscale("log", base=2)
    a3.set(xlabel="training step (S doubles after 2 clean steps)",
           ylabel="loss scale S (log2 axis)",
           title="loss scale (fp16 dynamic scaling;\ndrops mark overflow steps)")
    a3.legend(fontsize=8)
    for ax in (a1, a2, a3):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = lesson_parser(__doc__, ranks=2)
    parser.add_argument("--layers", type=positive_int, default=2)
    parser.add_argument("--dim", type=positive_int, default=64, help="d_model, a multiple of the 4 heads")
    parser.add_argument("--seq", type=positive_int, default=32)
    parser.add_argument("--batch", type=positive_int, default=4, help="sequences per rank")
    parser.add_argument("--steps", type=positive_int, default=8,
                        help="training steps (>= 7: the loss-scale timeline injects infs at steps 3 and 6)")
    parser.add_argument("--lr", type=positive_float, default=3e-3)
    args = parser.parse_args(argv)
    if args.dim % 4:
        parser.error(f"argument --dim: must be a multiple of the 4 attention heads, got {args.dim}")
    launch(rank_main, args)


if __name__ == "__main__":
    from minidist.lessons.cli import run_lesson

    run_lesson(main)
