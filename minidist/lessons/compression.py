"""Lesson 12: communicating less -- gradient compression, PowerSGD and DiLoCo on an emulated slow link.

    mpirun -n 4 python -m minidist.lessons.compression
    python -m minidist.lessons.compression --ranks 4 [--link alpha_us=50,gbps=1] [--plot FILE.png]

The same GPT is trained for the same steps on the course text by data parallelism whose gradients
go, step by step, dense (fp32), in bf16, top-k 1% + error feedback, QSGD 4-bit, sign + error
feedback, PowerSGD r = 2 and r = 8 (DDP communication hooks, ``minidist.parallel.data.compress``), and by
DiLoCo (H local AdamW steps, then one all-reduce of the parameter delta) and its streaming variant
(``minidist.parallel.data.local_sgd``). Every message crosses an emulated link (``--link``, default a
1 Gb/s link with 50 us latency: ``minidist.comm.transports.link``). For each method rank 0 prints the bytes it
sent per step (ledger) beside the method's formula, the compression ratio, the final loss on held-out
windows beside dense's, and the wall time per step. Checks: bytes == formula, replicas identical.
It prints, and ``--plot`` shows, the bytes each method needed to reach dense's loss:
loss vs steps, and loss vs cumulative bytes on a log axis with a band at dense's final loss
(``minidist.lessons.compression_curves``).
"""

from __future__ import annotations

import hashlib
import math
import sys
import time

import numpy as np

from minidist.accel.backend import to_host
from minidist.autograd.tensor import no_grad
from minidist.comm import all_reduce, measure
from minidist.lessons.cli import finish, launch, lesson_parser, positive_float, positive_int, rprint
from minidist.lessons.compression_curves import plot, print_bytes_at_dense_loss
from minidist.lessons.progress import progress
from minidist.nn import GPT, GPTConfig, optim
from minidist.nn.data import BatchLoader, ByteTokenizer, TextDataset, default_text
from minidist.parallel.data.compress import make_hook
from minidist.parallel.data.compress.powersgd import matrix_shape
from minidist.parallel.data.ddp import DDP
from minidist.parallel.data.local_sgd import LocalSGD
from minidist.trace.clock import now

# name -> (hook name and arguments) for DDP, or ("diloco", LocalSGD arguments)
METHODS = {
    "dense": ("dense", {}),
    "bf16": ("bf16", {}),
    "top-k 1% + EF": ("topk", {"ratio": 0.01}),
    "QSGD 4-bit": ("qsgd", {"levels": 7}),
    "sign + EF": ("sign", {}),
    "PowerSGD r=2": ("powersgd", {"rank": 2}),
    "PowerSGD r=4": ("powersgd", {"rank": 4}),
    "PowerSGD r=8": ("powersgd", {"rank": 8}),
    "DiLoCo H=20": ("diloco", {"H": 20}),
    "streaming DiLoCo": ("diloco", {"H": 20, "fragments": 4, "overlap": 1}),
}
LESSON = [m for m in METHODS if m != "PowerSGD r=4"]


# -- the formulas: bytes rank r sends, written out per method ----------------------------------------

def ring(n: int, p: int, itemsize: int, r: int = 0) -> int:
    """Ring all-reduce of n elements: rank r sends every chunk but its own, then every chunk but r+1's
    (chunks: np.array_split of n into p): 2(p-1)/p·n·itemsize when p divides n."""
    if p == 1:
        return 0
    c = [n // p + (i < n % p) for i in range(p)]
    return itemsize * (2 * n - c[r] - c[(r + 1) % p])


def step_formula(hook: str, kw: dict, shapes: list, p: int, itemsize: int = 4) -> int:
    """Bytes one bucket of parameters ``shapes`` costs rank 0 per step with ``hook`` on p ranks."""
    n = sum(math.prod(s) for s in shapes)
    if hook == "dense":
        return ring(n, p, itemsize)
    if hook == "bf16":
        return ring(n, p, 2)
    if hook == "topk":                                        # k (int32 index, value) pairs, all-gather
        return (p - 1) * max(1, math.ceil(kw["ratio"] * n)) * (4 + itemsize)
    if hook == "qsgd":                                        # 1 sign + ceil(log2(s+1)) level bits, norm
        bits = 1 + math.ceil(math.log2(kw["levels"] + 1))
        return (p - 1) * (math.ceil(n * bits / 8) + itemsize)
    if hook == "sign":                                        # 1 bit per entry and a scale
        return (p - 1) * (math.ceil(n / 8) + itemsize)
    if hook == "powersgd":                                    # P (n x r) with the 1-D tensors; Q (m x r)
        mats = [matrix_shape(s) for s in shapes if matrix_shape(s)]
        rs = [min(kw["rank"], a, b) for a, b in mats]
        vec = sum(math.prod(s) for s in shapes if not matrix_shape(s))
        return ring(sum(a * r for (a, _), r in zip(mats, rs)) + vec, p, itemsize) + \
            ring(sum(b * r for (_, b), r in zip(mats, rs)), p, itemsize)
    raise ValueError(hook)


# -- training ----------------------------------------------------------------------------------------

def config(args) -> GPTConfig:
    return GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=4, d_model=args.d_model,
                     seed=args.seed)


def data(args, p):
    ds = TextDataset(ByteTokenizer().encode(default_text()), args.seq)
    loader = BatchLoader(ds, args.batch * p, seed=args.seed)
    train = [loader.next_batch() for _ in range(args.steps)]
    held_out = ds.get(np.arange(len(ds) - 16, len(ds)))  # the text's last windows
    return train, held_out


def fingerprint(model) -> str:
    h = hashlib.sha256()
    for q in model.parameters():
        h.update(np.ascontiguousarray(to_host(q.data)).tobytes())
    return h.hexdigest()


def train(comm, args, name, batches, held_out, bar=None):
    """Train with method ``name``; returns a dict of what the table and the plot show (every rank).
    ``bar``: a progress bar (``minidist.lessons.progress``) advanced once per step."""
    hook, kw = METHODS[name]
    model = GPT(config(args))
    inner = optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    if hook == "diloco":
        wrapper = LocalSGD(model, comm, inner, outer_lr=args.outer_lr, momentum=0.9, **kw)
        per_step = None
    else:
        wrapper = DDP(model, comm, bucket_bytes=args.bucket_kb * 1024)
        if hook != "dense":
            wrapper.register_comm_hook(*make_hook(hook, **kw))
        per_step = sum(step_formula(hook, kw, [q.shape for q in b.params], comm.size)
                       for b in wrapper.buckets)
    rows = slice(args.batch * comm.rank, args.batch * (comm.rank + 1))
    losses, sent, times, evals = [], [], [], []
    with measure(comm) as total:  # all of it: an async sync's bytes may fall between two steps' windows
        for x, y in batches:
            comm.barrier()
            t0 = now()  # the rank's virtual time on the virtual clock, else wall time
            with measure(comm) as m:
                loss = model.loss(x[rows], y[rows])
                if hook == "diloco":
                    loss.backward()
                    wrapper.step()
                else:
                    wrapper.backward(loss)
                    wrapper.wait_gradients()
                    inner.step()
                inner.zero_grad()
                loss.backend.synchronize()  # a GPU's queued kernels are part of the step (NumPy: no-op)
            times.append(now() - t0)
            sent.append(m.bytes_sent)
            losses.append(loss.item())
            if bar is not None:
                bar.update(1)
            if comm.rank == 0 and (len(sent) % args.eval_every == 0 or len(sent) == len(batches)):
                with no_grad():  # rank 0 alone, held-out windows: no message, ledger untouched
                    evals.append((len(sent), bytes_so_far(hook, wrapper, sent, comm.size),
                                  model.loss(*held_out).item()))
        if hook == "diloco":
            wrapper.finish_pending()  # a streaming sync still in flight
    losses = list(all_reduce(comm, np.array(losses), op="mean"))  # the global batch's mean, per step
    if hook == "diloco":
        frag_n = [sum(b.numel for b in f.buckets) for f in wrapper.fragments]
        formula = sum(ring(frag_n[f], comm.size, 4) for _, f in wrapper.started)
        anchors = b"".join(a.tobytes() for a in wrapper.anchors())
        same = comm.allgather_obj(hashlib.sha256(anchors).hexdigest())
    else:
        formula = per_step * len(batches)
        same = comm.allgather_obj(fingerprint(model))
    with no_grad():
        final = float(all_reduce(comm, np.array([model.loss(*held_out).item()]), op="mean")[0])
    return {"name": name, "losses": losses, "sent": sent, "total": total.bytes_sent, "formula": formula,
            "identical": len(set(same)) == 1, "final": final, "step_s": float(np.median(times[1:] or times)),
            "first_s": times[0], "evals": evals, "n_params": sum(q.size for q in model.parameters())}


def bytes_so_far(hook: str, wrapper, sent: list, p: int) -> int:
    """The bytes rank 0's syncs so far send: what each step's window counted, or for DiLoCo the
    syncs it has started (a streaming sync's bytes leave on the worker whenever the link takes
    them, so a window may or may not have seen them yet: the evaluation must not depend on that)."""
    if hook != "diloco":
        return sum(sent)
    sizes = [sum(b.numel for b in f.buckets) for f in wrapper.fragments]
    return sum(ring(sizes[f], p, 4) for _, f in wrapper.started)


def ratio_cell(dense_bytes: float, sent: float) -> str:
    """The ratio column (8 wide): dense's bytes over the method's, "-" where it sent none (DiLoCo
    before its first sync: the ratio is undefined, not dense's byte count)."""
    return f"{dense_bytes / sent:>7.1f}x" if sent > 0 else f"{'-':>8}"


def table_row(r: dict, dense: dict) -> str:
    """One method's row: bytes per step beside the formula, ratio, loss, step time, checks."""
    steps, good = len(r["sent"]), r["total"] == r["formula"] and r["identical"]
    return (f"{r['name']:<18}{r['total'] / steps:>12.0f}{r['formula'] / steps:>12.0f}"
            f"{ratio_cell(dense['total'], r['total'])}{r['final']:>12.4f}"
            f"{100 * (r['final'] / dense['final'] - 1):>+9.1f}%{1e3 * r['step_s']:>9.1f}"
            f"{dense['step_s'] / r['step_s']:>8.1f}x  "
            f"bytes {'==' if r['total'] == r['formula'] else '!='} formula, replicas "
            f"{'identical' if r['identical'] else 'DIFFER'}: {'PASS' if good else 'FAIL'}")


def table_header() -> str:
    return (f"{'method':<18}{'bytes/step':>12}{'formula':>12}{'ratio':>8}{'final loss':>12}"
            f"{'vs dense':>10}{'ms/step':>9}{'speed-up':>9}  checks")


def table(comm, results: list, p: int) -> bool:
    dense = results[0]
    rprint(comm, table_header())
    ok = True
    for r in results:
        ok &= r["total"] == r["formula"] and r["identical"]
        rprint(comm, table_row(r, dense))
    silent = [r["name"] for r in results if r["total"] == 0]
    if silent:
        rprint(comm, f"(ratio -: {', '.join(silent)} sent nothing in {len(results[0]['sent'])} steps -- "
                     "DiLoCo's first sync is after H local steps)")
    return ok


def rank_main(comm, args):
    p = comm.size
    batches, held_out = data(args, p)
    rprint(comm, f"{p} ranks, {args.steps} steps of a GPT ({args.layers} layers, d_model {args.d_model}) "
                 f"on the course text, {args.batch} windows of {args.seq} bytes per rank per step; link: "
                 f"{comm.link or 'none (memory)'}")
    results = []
    bar = progress(total=len(args.methods) * args.steps, desc="training", rank=comm.rank)
    for i, name in enumerate(args.methods):  # a line per method as it ends: a long run shows its progress
        t0 = time.perf_counter()
        bar.set_postfix(method=name)
        results.append(train(comm, args, name, batches, held_out, bar))
        r = results[-1]
        if comm.rank == 0:  # above the bar (tqdm.write), or a plain line where no bar is drawn
            bar.write(f"  [{i + 1}/{len(args.methods)}] {name:<18} {len(r['losses'])} steps in "
                      f"{time.perf_counter() - t0:6.1f} s (first step {r['first_s']:.2f} s, then "
                      f"{1e3 * r['step_s']:.1f} ms per step)", file=sys.stdout)
    bar.close()
    rprint(comm, f"parameters: {results[0]['n_params']} (fp32); bytes are rank 0's, sent per step\n")
    ok = table(comm, results, p)
    print_bytes_at_dense_loss(comm, results)
    if comm.link is not None:
        n = results[0]["n_params"] * 4
        rprint(comm, f"\nthe link's alpha-beta time of one dense ring all-reduce: "
                     f"{1e3 * comm.link.predict_all_reduce('ring', n, p):.1f} ms per step")
    if args.plot and comm.rank == 0:
        plot(args.plot, results)
        print(f"wrote {args.plot}: loss vs steps and loss vs cumulative bytes sent", flush=True)
    return finish(comm, ok)


def parser():
    ap = lesson_parser(__doc__.split("\n\n")[0], ranks=4)
    ap.add_argument("--steps", type=positive_int, default=40)
    ap.set_defaults(link="alpha_us=50,gbps=1")  # the emulated slow link (--link off: memory speed)
    ap.add_argument("--layers", type=positive_int, default=2)
    ap.add_argument("--d-model", type=positive_int, default=128)
    ap.add_argument("--seq", type=positive_int, default=32)
    ap.add_argument("--batch", type=positive_int, default=2, help="windows per rank per step")
    ap.add_argument("--lr", type=positive_float, default=3e-3)
    ap.add_argument("--outer-lr", type=positive_float, default=0.7)
    ap.add_argument("--eval-every", type=positive_int, default=4,
                    help="steps between held-out evaluations of rank 0's replica (the plot's points)")
    ap.add_argument("--bucket-kb", type=positive_int, default=4096)
    ap.add_argument("--methods", nargs="+", choices=list(METHODS), default=LESSON, metavar="METHOD",
                    help="which methods (default: all but PowerSGD r=4): "
                         + ", ".join(METHODS).replace("%", "%%"))
    return ap


def main(argv=None):
    args = parser().parse_args(argv)
    if args.methods[0] != "dense":
        args.methods = ["dense"] + [m for m in args.methods if m != "dense"]  # the baseline comes first
    return launch(rank_main, args)  # (launch puts --link into effect before any communicator exists)


if __name__ == "__main__":
    from minidist.lessons.cli import run_lesson

    run_lesson(main)
