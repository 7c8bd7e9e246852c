"""Lesson 15: mixture of experts -- routing, capacity, the load-balancing loss, expert parallelism.

    mpirun -n 4 python -m minidist.lessons.moe
    python -m minidist.lessons.moe --ranks 4 [--experts 8] [--steps 40] [--plot FILE.png]

An MoE block (``minidist.nn.moe``) with its experts split over every rank (ep = world size,
``minidist.parallel.experts.dispatch``); each rank routes its own tokens. Rank 0 prints:

1. expert parallelism vs the serial MoE on each rank's tokens (outputs and every gradient): PASS;
2. training the block on a toy regression whose router starts badly skewed: tokens per expert and
   their coefficient of variation (CV) per step, with the Switch load-balancing loss and without
   (PASS: the aux loss ends with at most half the CV of the run without it);
3. the capacity-factor trade-off: dropped tokens vs padded (empty, still computed) expert slots;
4. the ledger's all-to-all bytes beside 2·(ep-1)·(E/ep)·C·d·8 per direction.
"""

from __future__ import annotations

import numpy as np

from minidist.accel.backend import default_backend, to_host
from minidist.autograd.tensor import Tensor, no_grad
from minidist.comm import all_reduce, measure
from minidist.lessons.cli import (
    finish,
    launch,
    lesson_parser,
    positive_float,
    positive_int,
    reject_early,
    rprint,
    world_size,
    worst,
)
from minidist.lessons.progress import progress
from minidist.nn import optim
from minidist.nn.moe import MoE
from minidist.parallel.experts.dispatch import ExpertParallelMoE, all_to_all_bytes

D, HIDDEN = 8, 16
TOL = 1e-10


def build(comm, args, cf=None, serial=False):
    kw = dict(hidden=HIDDEN, dtype=np.float64, std=0.3, rng=np.random.default_rng(args.seed))
    if serial:
        return MoE(D, args.experts, args.k, cf or args.capacity, **kw)
    return ExpertParallelMoE(D, args.experts, comm, args.k, cf or args.capacity, **kw)


def tokens(args, rank, n=None, shift=1.5):
    """This rank's tokens: a shared offset makes a random router send most of them one way."""
    rng = np.random.default_rng(1000 * args.seed + rank)
    return rng.standard_normal((n or args.tokens, D)) + shift


def on_backend(a, requires_grad=False) -> Tensor:
    """Host data as a tensor on the lesson's backend (CuPy will not mix NumPy into its kernels)."""
    return Tensor(a, requires_grad=requires_grad, backend=default_backend())


def _max_diff(a, b) -> float:
    """max |a - b|, on the host (on JAX a device subtract would be one more program per shape)."""
    return float(np.abs(to_host(a) - to_host(b)).max())


SKEW = 0.6  # added to the router's expert-0 column at the start of training: most tokens go there
# The least --steps for section 2's check: at the lesson's defaults the CV with the aux loss first
# falls to half the CV without it at step 24 (chapter 15), and no other size tried halves it sooner
# (fewer tokens per expert take longer): fewer steps are refused rather than made to print FAIL.
MIN_STEPS = 25
# Routed tokens per expert per step (on average) for section 2's check within MIN_STEPS..40 steps: at
# 16 and 24 per expert (--ranks 2 --experts 4 --tokens 16 or 24) the CV with the aux loss does not
# halve by step 40; at 32 it does for every size tried (chapter 15 lists them).
MIN_PER_EXPERT = 32


def check_counts(p: int, experts: int, k: int, tokens: int) -> None:
    """Section 2 compares the CV of tokens per expert: with a handful of tokens per expert it is
    noise and its PASS/FAIL means nothing. Refuse such flags, naming the --tokens that suffice."""
    if p * tokens * k < MIN_PER_EXPERT * experts:
        need = -(-MIN_PER_EXPERT * experts // (p * k))
        raise ValueError(f"argument --tokens: {tokens} tokens per rank x {p} ranks x top-{k} route "
                         f"{p * tokens * k} tokens to {experts} experts, fewer than {MIN_PER_EXPERT} per "
                         f"expert (too few for section 2's CV to halve in the lesson's steps); "
                         f"use --tokens >= {need}")


def twin_check(comm, args):
    """Expert-parallel forward/backward vs the serial MoE on every rank's tokens; max diff on rank 0."""
    moe = build(comm, args)
    xs = [tokens(args, r) for r in range(comm.size)]
    g = np.random.default_rng(7).standard_normal((args.tokens, D))
    x = on_backend(xs[comm.rank], requires_grad=True)
    with measure(comm) as fwd:
        y = moe(x)
    loss = (y * on_backend(g)).sum() + moe.stats.aux_loss + moe.stats.z_loss
    with measure(comm) as bwd:
        loss.backward()
    grads = {moe.global_name(n): (all_reduce(comm, p.grad) if n.startswith("router") else p.grad)
             for n, p in moe.named_parameters()}
    got = comm.gather_obj((y.data, x.grad, grads, moe.stats.capacity, fwd.bytes_sent, bwd.bytes_sent), root=0)
    if comm.rank != 0:
        return None
    ser = build(comm, args, serial=True)
    diff, total, all_grads = 0.0, 0, {}
    for r, xr in enumerate(xs):
        xt = on_backend(xr, requires_grad=True)
        yr = ser(xt)
        total = (yr * on_backend(g)).sum() + ser.stats.aux_loss + ser.stats.z_loss
        total.backward()
        diff = worst(diff, _max_diff(yr.data, got[r][0]), _max_diff(xt.grad, got[r][1]))
        all_grads.update(got[r][2])
    for n, p in ser.named_parameters():
        diff = worst(diff, _max_diff(p.grad, all_grads[n]))
    return diff, [(c, f, b) for _, _, _, c, f, b in got]


def train(comm, args, aux_weight):
    """Train the block (ep over every rank) on a toy regression; per step: routed counts, CV, dropped."""
    moe = build(comm, args)
    w = moe.router.weight  # a skewed start: the router favours expert 0
    skewed = np.array(to_host(w.data))  # made on the host (on JAX: no eager slice-and-add programs)
    skewed[:, 0] += SKEW
    w.data = w.backend.update(w.data, skewed)  # in place on NumPy, a new array on JAX (immutable)
    opt = optim.make_optimizer("adamw", moe.parameters(), args.lr)
    target = np.random.default_rng(99).standard_normal((D, D)) / np.sqrt(D)
    history = []
    for step in progress(range(args.steps), desc="train", rank=comm.rank):
        x = tokens(args, comm.rank + 100 * step)
        y = moe(on_backend(x))
        err = y - on_backend(np.tanh(x @ target))
        loss = (err ** 2).mean() * (1.0 / comm.size)
        if aux_weight:  # (without it: not added at all, rather than added times zero)
            loss = loss + moe.stats.aux_loss * (aux_weight / comm.size)
        loss.backward()
        for name, p in moe.named_parameters():  # the router is replicated: sum its partial gradients
            if name.startswith("router"):
                p.grad = all_reduce(comm, p.grad)
        opt.step()
        opt.zero_grad()
        counts = np.concatenate([moe.stats.tokens_per_expert, moe.stats.kept_per_expert])
        routed, kept = np.split(all_reduce(comm, counts.astype(np.float64)), 2)  # one collective for both
        history.append((routed, float(routed.std() / routed.mean()), 1 - kept.sum() / routed.sum()))
    return moe, history


def capacity_table(comm, args, moe):
    """Route the same tokens at several capacity factors: dropped fraction and padded slots. The
    routing alone decides both (``MoE.route``): the experts need not run."""
    rows = []
    x = on_backend(tokens(args, comm.rank + 100 * args.steps))
    for cf in (0.5, 1.0, 1.25, 1.5, 2.0):
        moe.capacity_factor = cf
        with no_grad():
            _, _, experts, used, cap = moe.route(x)
        kept_here = np.bincount(experts[used >= 0], minlength=args.experts)  # per expert, this rank
        kept = all_reduce(comm, kept_here.astype(np.float64)).sum()
        slots = comm.size * args.experts * cap  # every rank's E x C buffer
        rows.append((cf, cap, 1 - kept / (comm.size * args.tokens * args.k), 1 - kept / slots))
    moe.capacity_factor = args.capacity
    return rows


def rank_main(comm, args):
    p, e = comm.size, args.experts
    rprint(comm, f"Mixture of experts: E = {e} experts, top-{args.k}, over ep = {p} ranks ({e // p} each); "
                 f"{args.tokens} tokens per rank, capacity factor {args.capacity}\n")
    ok = True
    checked = twin_check(comm, args)
    if comm.rank == 0:
        diff, sent = checked
        verdict = "PASS" if diff <= TOL else "FAIL"
        ok &= verdict == "PASS"
        print(f"1. expert parallel vs serial MoE on each rank's tokens (outputs, input and parameter "
              f"gradients, float64): max |diff| = {diff:.2e}  {verdict}")

    balanced, with_aux = train(comm, args, args.aux)
    skewed, without = train(comm, args, 0.0)
    if comm.rank == 0:
        print(f"\n2. training with the load-balancing loss (weight {args.aux}) and without: tokens routed "
              f"per expert (all ranks), CV = std/mean")
        print(f"   {'step':>4}  {'with aux: tokens per expert':<{6 * e}}  {'CV':>5}  {'dropped':>7}   "
              f"{'without: CV':>11}  {'dropped':>7}")
        for s in sorted({0, 1, 2, 5, 10, 20, args.steps - 1} & set(range(args.steps))):
            counts, cv, dropped = with_aux[s]
            shown = " ".join(f"{int(c):>5}" for c in counts)
            print(f"   {s:>4}  {shown:<{6 * e}}  {cv:>5.2f}  {dropped:>7.1%}   "
                  f"{without[s][1]:>11.2f}  {without[s][2]:>7.1%}")
        falls = with_aux[-1][1] < 0.5 * without[-1][1]  # False on a NaN CV
        ok &= falls
        print(f"   CV {with_aux[0][1]:.2f} -> {with_aux[-1][1]:.2f} with the aux loss, "
              f"{without[0][1]:.2f} -> {without[-1][1]:.2f} without  {'PASS' if falls else 'FAIL'}")

    rows = zip(capacity_table(comm, args, balanced), capacity_table(comm, args, skewed))
    if comm.rank == 0:
        print("\n3. capacity factor trade-off: C = ceil(cf·k·N/E) slots per expert; a dropped token skips "
              "the expert,\n   a padded slot is computed for nothing")
        print(f"   {'':>10}  {'balanced router (aux)':>23}  {'skewed router (no aux)':>23}")
        print(f"   {'cf':>5}  {'C':>3}  {'dropped':>11}  {'padded':>9}  {'dropped':>11}  {'padded':>9}")
        for (cf, cap, d1, p1), (_, _, d2, p2) in rows:
            print(f"   {cf:>5.2f}  {cap:>3}  {d1:>11.1%}  {p1:>9.1%}  {d2:>11.1%}  {p2:>9.1%}")

        cap = sent[0][0]
        want = all_to_all_bytes(e, p, cap, D, 8)
        good = all(s == (cap, want["forward"], want["backward"]) for s in sent)
        ok &= good
        print(f"\n4. all-to-all bytes per rank (C = {cap}): two all-to-alls of ep-1 blocks of (E/ep)·C·d "
              f"float64 each way")
        print(f"   forward  2·{p - 1}·{e // p}·{cap}·{D}·8 = {want['forward']:>6}   measured "
              f"{sorted({s[1] for s in sent})}")
        print(f"   backward 2·{p - 1}·{e // p}·{cap}·{D}·8 = {want['backward']:>6}   measured "
              f"{sorted({s[2] for s in sent})}  {'PASS' if good else 'FAIL'}")
        if args.plot:
            plot(args.plot, with_aux, without)
            print(f"\n   wrote {args.plot}")
    return finish(comm, ok)


def plot(path, with_aux, without):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 3.2))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.plot([h[1] for h in with_aux], label="with load-balancing loss")
    ax.plot([h[1] for h in without], label="without")
    ax.set_xlabel("training step")
    ax.set_ylabel("CV of tokens per expert (std / mean)")
    ax.set_title("router balance with and without the auxiliary loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None):
    parser = lesson_parser(__doc__.split("\n")[0], ranks=4)
    parser.add_argument("--experts", type=positive_int, default=8, help="experts (a multiple of the ranks)")
    parser.add_argument("--k", type=positive_int, default=2, choices=[1, 2], help="experts per token")
    parser.add_argument("--tokens", type=positive_int, default=64, help="tokens per rank per step")
    parser.add_argument("--capacity", type=positive_float, default=1.25, help="capacity factor")
    parser.add_argument("--steps", type=positive_int, default=40,
                        help=f"training steps of section 2 (at least {MIN_STEPS})")
    parser.add_argument("--lr", type=positive_float, default=0.02)
    parser.add_argument("--aux", type=positive_float, default=0.1, help="weight of the load-balancing loss")
    args = parser.parse_args(argv)
    p = world_size(args)
    if args.experts % p:
        parser.error(f"--experts {args.experts} must be a multiple of the {p} ranks (experts per rank)")
    if args.k >= args.experts:
        more = (args.k // p + 1) * p
        parser.error(f"argument --k: top-{args.k} of --experts {args.experts} sends every token to every "
                     f"expert, so tokens per expert are equal with or without the aux loss (section 2 has "
                     f"nothing to balance); use --k < --experts, e.g. --experts {more}")
    if args.steps < MIN_STEPS:
        parser.error(f"argument --steps: section 2 checks that the aux loss halves the CV of tokens per "
                     f"expert, and the router needs {MIN_STEPS} steps to unlearn its skewed start (at the "
                     f"lesson's sizes and --lr; fewer tokens per expert need more); got {args.steps}, "
                     f"use --steps {MIN_STEPS} or more")
    reject_early(parser, lambda: check_counts(p, args.experts, args.k, args.tokens))
    launch(rank_main, args)


if __name__ == "__main__":
    from minidist.lessons.cli import run_lesson

    run_lesson(main)
