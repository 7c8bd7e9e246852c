"""Lesson 7b: the numerics lab -- one GPT trained in fp64, fp32, bf16, fp16 + loss scaling and FP8.

    python -m minidist.lessons.numerics --ranks 2
    mpirun -n 2 python -m minidist.lessons.numerics

Data-parallel ranks train the same small GPT (the copy task of lesson 7) for a fixed number of
steps in every format: fp64 (checked against its serial twin), fp32, bf16 and fp16 with fp32 master
weights (fp16 with the dynamic loss scale), and FP8 Linears (e4m3 forward, e5m2 gradients) under
each scaling recipe: current, delayed (amax history) and block-wise. One table: final loss, its gap
to fp64, steps skipped, and the largest relative error of a gradient vs fp64 at the shared initial
weights. Then one activation gets an outlier: per-tensor scales flush its small values to zero,
delayed scaling saturates the outlier itself and then flushes the next step too, block scaling
loses only the outlier's tile. Target: block-wise FP8 within 2% of bf16's final loss.
"""

from __future__ import annotations

import numpy as np

from minidist.accel.backend import to_host
from minidist.comm import all_reduce
from minidist.lessons.cli import finish, launch, lesson_parser, positive_float, positive_int, rprint
from minidist.lessons.progress import progress
from minidist.nn.gpt import GPT, GPTConfig
from minidist.nn.optim import AdamW
from minidist.nn.serial import train_serial
from minidist.parallel.memory.fp8 import Fp8Quantizer, Fp8Recipe, fp8_linear
from minidist.parallel.memory.fp8_formats import E4M3
from minidist.parallel.memory.fp8_scaling import amax_of
from minidist.parallel.memory.precision import MixedPrecision

TARGET = 0.02  # block-wise FP8's final loss within 2% of bf16's
TWIN_TOL = 1e-9  # fp64 data-parallel vs its serial twin: only the summation order differs
RUNS = ("fp64", "fp32", "bf16", "fp16", "fp8 current", "fp8 delayed", "fp8 block")


def batches(cfg, p, b, steps, seed):
    """The global batch of every step (the same on every rank; rank r takes rows r·b .. r·b+b)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, cfg.vocab_size, (p * b, cfg.block_size)) for _ in range(steps)]


def average_grads(comm, params):
    """Mean of the gradients over ranks: one flat all-reduce (the gradients' own dtype)."""
    flat = np.concatenate([to_host(q.grad).ravel() for q in params])
    flat = all_reduce(comm, flat, op="sum") / flat.dtype.type(comm.size)
    o = 0
    for q in params:
        q.grad = flat[o:o + q.size].reshape(q.shape)
        o += q.size


def train(comm, cfg, run, data, b, lr, block):
    """One format's run: (losses averaged over ranks, steps skipped, the first step's gradients)."""
    if run in ("fp64", "fp32"):
        cfg = GPTConfig(**{**cfg.__dict__, "dtype": "float64" if run == "fp64" else "float32"})
    model, mp = GPT(cfg), None
    if run.startswith("fp8"):
        scaling = run.split()[1]
        fp8_linear(model, Fp8Recipe(scaling, block=block))
    if run in ("bf16", "fp16"):
        mp = MixedPrecision(model, run, groups=[comm])
    opt = AdamW(mp.master_params if mp else model.parameters(), lr=lr)
    losses, first = [], None
    for step, batch in enumerate(progress(data, desc=run, rank=comm.rank)):
        idx = batch[comm.rank * b:(comm.rank + 1) * b]
        if mp:
            loss = mp.loss(idx, idx)
            mp.backward(loss)
            mp.all_reduce_grads(comm)
            if step == 0:
                first = [to_host(q.grad).astype(np.float64) / mp.scale for q in mp.params]
            mp.step(opt)
        else:
            loss = model.loss(idx, idx)
            loss.backward()
            average_grads(comm, model.parameters())
            if step == 0:
                first = [to_host(q.grad).astype(np.float64) for q in model.parameters()]
            opt.step()
            opt.zero_grad()
        losses.append(float(np.mean(comm.allgather_obj(loss.item()))))
    skipped = mp.scaler.skipped if mp and mp.scaler else 0
    return losses, skipped, first


def grad_error(first, ref) -> float:
    """max over parameter tensors of ||g - g_fp64|| / ||g_fp64||."""
    return max(float(np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-300)) for g, r in zip(first, ref))


def outlier_experiment(x, block, factor=1e5, history=4):
    """An activation (rows, features) with one entry made ``factor`` times its amax: per recipe, the
    share of the other entries flushed to 0, their relative error, and the outlier's relative error;
    for delayed scaling also the step after (its scale still from the outlier's amax)."""
    spike = x.copy()
    spike[0, 0] = factor * amax_of(x)
    small = np.ones(x.shape, bool)
    small[0, :block] = False  # the outlier's own 1 x block tile
    rows = []
    for scaling in ("current", "delayed", "block"):
        q = Fp8Quantizer(Fp8Recipe(scaling, block=block, history=history))
        for _ in range(history):  # earlier, quiet steps fill the delayed window
            q.quantize("x", x, E4M3, amax_of(x))
        cases = [("outlier step", spike)] + ([("next step", x)] if scaling == "delayed" else [])
        for when, a in cases:
            d = q.quantize("x", a, E4M3, amax_of(a))
            nz = small & (a != 0)
            flushed = float(np.mean(d[nz] == 0))
            err = float(np.linalg.norm(d[small] - a[small]) / np.linalg.norm(a[small]))
            out_err = abs(float(d[0, 0]) - float(a[0, 0])) / abs(float(a[0, 0])) if a is spike else None
            rows.append((scaling, when, flushed, err, out_err))
    return rows


def first_activation(cfg, idx):
    """The input of the first block's MLP (after its LayerNorm) for ``idx``: (rows, d_model)."""
    model = GPT(cfg)
    h = model[0](idx)
    blk = model[1]
    h = h + blk.attn(blk.ln1(h))
    return to_host(blk.ln2(h).data).reshape(-1, cfg.d_model).astype(np.float32)


def rank_main(comm, args):
    p, b = comm.size, args.batch
    cfg = GPTConfig(vocab_size=64, block_size=args.seq, n_layer=args.layers, n_head=4, d_model=args.dim,
                    seed=args.seed)
    rprint(comm, __doc__.split("\n\n")[2].strip() + "\n")
    data = batches(cfg, p, b, args.steps, args.seed)
    runs = {r: train(comm, cfg, r, data, b, args.lr, args.block) for r in RUNS}
    ok = True
    if comm.rank == 0:
        cfg64 = GPTConfig(**{**cfg.__dict__, "dtype": "float64"})
        twin = train_serial(cfg64, [(d, d) for d in data], lr=args.lr, optimizer="adamw",
                            weight_decay=0.01)[1]
        diff = max(abs(a - t) for a, t in zip(runs["fp64"][0], twin))
        ok = diff <= TWIN_TOL
        print(f"fp64 on {p} ranks vs its serial twin: max loss difference {diff:.1e} "
              f"(tolerance {TWIN_TOL:g}) {'PASS' if ok else 'FAIL'}\n", flush=True)
        ref_loss, ref_grad = runs["fp64"][0][-1], runs["fp64"][2]
        print(f"{p} ranks x {b} sequences of {cfg.block_size} tokens, GPT {cfg.n_layer} layers "
              f"d={cfg.d_model}, AdamW lr {args.lr}, {args.steps} steps; FP8 tiles 1x{args.block} "
              f"(activations, gradients) and {args.block}x{args.block} (weights):")
        print(f"{'run':<12} {'final loss':>10} {'gap to fp64':>12} {'skipped':>8} {'max rel grad err':>17}")
        for r, (losses, skipped, first) in runs.items():
            gap = (losses[-1] - ref_loss) / ref_loss
            err = grad_error(first, ref_grad)
            print(f"{r:<12} {losses[-1]:>10.5f} {gap:>+12.2%} {skipped:>8} {err:>17.2e}")
        bf16, blk = runs["bf16"][0][-1], runs["fp8 block"][0][-1]
        met = abs(blk - bf16) <= TARGET * bf16
        print(f"\ntarget: FP8 block-wise final loss within {TARGET:.0%} of bf16's: {blk:.5f} vs {bf16:.5f} "
              f"({(blk - bf16) / bf16:+.2%}) {'MET' if met else 'MISSED'}", flush=True)
        ok &= met

        rows = outlier_experiment(first_activation(cfg, data[0][:b]), args.block)
        print(f"\nan outlier: one entry of the first MLP's input set to 1e5 x its amax (e4m3, blocks of "
              f"1x{args.block}):")
        print(f"{'scaling':<9} {'when':<13} {'others flushed to 0':>20} {'others rel err':>15} "
              f"{'outlier rel err':>16}")
        for scaling, when, flushed, err, out_err in rows:
            o = "-" if out_err is None else f"{out_err:.2e}"
            print(f"{scaling:<9} {when:<13} {flushed:>20.1%} {err:>15.2e} {o:>16}")
        by = {(s, w): (f, e, o) for s, w, f, e, o in rows}
        kept = by[("block", "outlier step")][0] < 0.01 < by[("current", "outlier step")][0]
        delayed_fails = by[("delayed", "outlier step")][2] > 0.5 and by[("delayed", "next step")][0] > 0.5
        print(f"check: block scaling keeps the small values that per-tensor scaling flushes "
              f"{'PASS' if kept else 'FAIL'}; delayed scaling saturates the outlier and flushes the next "
              f"step {'shown' if delayed_fails else 'NOT shown: FAIL'}", flush=True)
        ok &= kept and delayed_fails
        if args.plot:
            plot(args.plot, runs)
            print(f"wrote {args.plot}")
    return finish(comm, ok)


def plot(path, runs):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4))
    FigureCanvasAgg(fig)
    ax, dax = fig.subplots(1, 2)
    ref = np.asarray(runs["fp64"][0]) if "fp64" in runs else None
    for r, (losses, _, _) in runs.items():
        ax.plot(losses, "k--" if r == "fp64" else "-", label=r)
        if ref is not None and r != "fp64":  # the curves overlap: their distance from fp64 shows each format
            dax.plot(np.asarray(losses) - ref, label=r)
    ax.set_xlabel("training step")
    ax.set_ylabel("training loss, nats/token")
    ax.set_title("the same training in each number format\n(dashed: fp64 reference)", fontsize=10)
    ax.legend()
    dax.axhline(0, color="k", lw=0.8)
    dax.set_xlabel("training step")
    dax.set_ylabel("loss − fp64 loss, nats/token")
    dax.set_title("difference from the fp64 reference", fontsize=10)
    dax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None):
    parser = lesson_parser(__doc__, ranks=2)
    parser.add_argument("--layers", type=positive_int, default=2)
    parser.add_argument("--dim", type=positive_int, default=64, help="d_model, a multiple of the 4 heads")
    parser.add_argument("--seq", type=positive_int, default=32)
    parser.add_argument("--batch", type=positive_int, default=4, help="sequences per rank")
    parser.add_argument("--steps", type=positive_int, default=30)
    parser.add_argument("--block", type=positive_int, default=16,
                        help="FP8 tile side (DeepSeek-V3: 128; 16 for this small model)")
    parser.add_argument("--lr", type=positive_float, default=3e-3)
    args = parser.parse_args(argv)
    if args.dim % 4:
        parser.error(f"argument --dim: must be a multiple of the 4 attention heads, got {args.dim}")
    launch(rank_main, args)


if __name__ == "__main__":
    from minidist.lessons.cli import run_lesson

    run_lesson(main)
