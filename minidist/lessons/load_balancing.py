"""Lesson 13: dynamic load balancing -- a straggler appears, is seen, and work moves while training runs.

    mpirun -n 4 python -m minidist.lessons.load_balancing        # ranks as MPI processes
    python -m minidist.lessons.load_balancing --ranks 4           # ranks as threads
    python -m minidist.lessons.load_balancing --slow "rank=1,factor=4,from_step=3" --plot lb.png

Part 1, data parallelism: every rank starts with an equal share of the global batch. At step 5 one
rank becomes 3x slower (``--slow``, or ``$MINIDIST_SLOW``). Each step the ranks agree on every
rank's compute and wait time with one tiny all-gather; the straggler detector names the slow rank;
every 2 steps the shares follow measured throughput, and the step time comes back down towards the
balanced time B / Σ s_i (printed per step, drawn per rank: compute ``#``, waiting ``.``). The
trained parameters equal the serial twin's whatever the shares.

Part 2, pipeline: a GPT cut into one stage per rank, two of its blocks 4x heavier (``--skew``).
Per-layer times are profiled while it trains; when the 1F1B step-time formula says the min-max cut
pays, layers move between stages with their parameters and optimizer state. Step time and bubble
before and after, beside the formula; the parameters equal the serial twin's across the move.
``--pace`` (seconds per row) emulates a fixed-speed device so the timings are clean even on a
laptop with fewer cores than ranks; ``--pace 0`` times the real compute alone.
"""

from __future__ import annotations

import os

import numpy as np

from minidist.lessons.cli import (
    finish,
    launch,
    lesson_parser,
    positive_int,
    rprint,
    world_size,
    worst,
)
from minidist.nn import GPTConfig
from minidist.nn.serial import host_state, max_state_diff, train_serial
from minidist.parallel.balance.dp import train_dp_balanced
from minidist.parallel.balance.pipeline import gather_stage_states, train_pipeline_balanced
from minidist.parallel.balance.repartition import bubble, stage_costs, step_time
from minidist.parallel.pipeline.partition import partition_uniform
from minidist.resilience.stragglers import Slowdown, parse

TOL = 1e-9  # float64: only the summation order differs from the serial twin
TARGET = 0.15  # step time after rebalancing within 15% of the balanced time


def _batches(rows, steps, vocab, seq, seed):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, vocab, (rows, seq)), rng.integers(0, vocab, (rows, seq))) for _ in range(steps)]


def _bar(compute, wait, scale, width=16):
    c = int(round(compute * scale))
    return ("#" * c + "." * int(round(wait * scale)))[:width].ljust(width)


# -- part 1: data-parallel shares ------------------------------------------------------------------

def data_parallel(comm, args, slow):
    """Train with moving shares, printing each step; returns (ok, numbers, run)."""
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, d_model=16, dtype="float64",
                    seed=args.seed)
    batches = _batches(args.batch, args.steps, 32, 8, args.seed)
    rprint(comm, f"Part 1 -- data parallelism on {comm.size} ranks, global batch {args.batch} rows, "
                 f"{slow.slows and ', '.join(_describe(s) for s in slow.slows if s.rank is not None)}"
                 f"; device pace {args.pace * 1e3:g} ms/row")
    rprint(comm, "step   step ms  balanced ms  shares" + " " * max(0, 4 * comm.size - 6) +
           "  per rank: compute # / wait .")
    scale = [12 / (args.pace * args.batch / comm.size) if args.pace else None]  # 12 marks: an equal share

    def on_step(step, run, table):
        if comm.rank:
            return
        if scale[0] is None:
            scale[0] = 12 / max(float(table[:, 0].max()), 1e-9)
        named = run.stragglers[-1]
        bars = " ".join(f"r{r}|{_bar(c, w, scale[0])}" for r, (c, w) in enumerate(table[:, :2]))
        flag = f"  straggler: rank {named}" if named else ""
        print(f"{step:4d} {run.step_seconds[-1] * 1e3:8.1f} {run.ideal_seconds[-1] * 1e3:10.1f}     "
              f"{str(run.shares[-1]):<{4 * comm.size + 2}} {bars}{flag}", flush=True)

    run = train_dp_balanced(comm, cfg, batches, slow=slow, every=2, window=2, on_step=on_step)
    want, want_losses = train_serial(cfg, batches, lr=0.1)
    diff = worst(max_state_diff(host_state(run.model), want), float(np.max(np.abs(np.subtract(run.losses,
                                                                                            want_losses)))))
    ok = diff <= TOL
    numbers = summarize_dp(run, slow)
    if comm.rank == 0:
        if run.detector.events:
            step, r, ratio = run.detector.events[0]
            print(f"detected: rank {r} is {ratio:.1f}x slower per row than the median rank (named at step "
                  f"{step})")
        for step, shares in [(s, sh) for s, sh in enumerate(run.shares[1:]) if sh != run.shares[s]]:
            print(f"shares moved after step {step}: {run.shares[step]} -> {shares}")
        for line in numbers["lines"]:
            print(line)
        print(f"monitor cost: one all-gather of {len(run.monitor.fields)} float64 per rank per step, median "
              f"{np.median(run.monitor.gather_seconds) * 1e6:.0f} us")
        print(f"serial twin: max |diff| {diff:.1e} over parameters and losses -> {'PASS' if ok else 'FAIL'}")
    return ok, numbers, run


def summarize_dp(run, slow) -> dict:
    """Median step time before the slowdown, with it unbalanced, and after the shares moved."""
    start = min((s.from_step for s in slow.slows if s.rank is not None), default=None)
    moved = [k + 1 for k in range(len(run.shares) - 1) if run.shares[k + 1] != run.shares[k]]
    t = np.array(run.step_seconds)
    lines = []
    out = {"lines": lines}
    if start is None or start >= len(t):
        lines.append("(no rank is slowed during the run: nothing to rebalance)")
        return out
    before = np.median(t[1:start]) if start > 1 else float("nan")  # step 0 pays for warm-up
    after_from = max([m for m in moved if m > start] or [len(t)])
    slowed = t[start:min(after_from, len(t))]
    after = t[after_from + 1:] if after_from + 1 < len(t) else t[after_from:]
    ideal = float(np.median(run.ideal_seconds[after_from:])) if after_from < len(t) else float("nan")
    out.update(before=before, unbalanced=float(np.median(slowed)) if slowed.size else float("nan"),
               balanced=float(np.median(after)) if after.size else float("nan"), ideal=ideal)
    lines.append(f"step time: {before * 1e3:.1f} ms before the slowdown, {out['unbalanced'] * 1e3:.1f} ms "
                 f"slowed with equal shares, {out['balanced'] * 1e3:.1f} ms after rebalancing")
    met = out["balanced"] <= (1 + TARGET) * ideal
    verdict = "MET" if met else "MISSED"
    lines.append(f"balanced time B / sum(s_i) = {ideal * 1e3:.1f} ms: after rebalancing "
                 f"{out['balanced'] / ideal:.2f}x it (target within {TARGET:.0%}): {verdict}")
    out["met"] = met
    return out


def _describe(s) -> str:
    who = f"rank {s.rank}" if s.rank is not None else f"layer {s.layer}"
    return f"{who} {s.factor:g}x slower from step {s.from_step}"


# -- part 2: pipeline re-partitioning --------------------------------------------------------------

def pipeline_layers(p: int) -> int:
    """Layers of part 2's GPT (embedding, blocks, head): at least 8, two per stage for 4+ stages."""
    return max(8, 2 * p)


def pipeline(comm, args, slow):
    """Train the pipeline, re-partitioned while it runs; returns (ok, numbers, run)."""
    p = comm.size
    n_layer = pipeline_layers(p) - 2
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=n_layer, n_head=2, d_model=16, dtype="float64",
                    seed=args.seed)
    batches = _batches(args.microbatches, args.pp_steps, 32, 8, args.seed + 1)  # one row per microbatch
    m = args.microbatches
    rprint(comm, f"\nPart 2 -- pipeline: {n_layer + 2} layers on {p} stages (1F1B, {m} microbatches), "
                 f"{', '.join(_describe(s) for s in slow.slows if s.layer is not None) or 'no skew'}")
    rprint(comm, "step   step ms   formula ms  bubble  partition (layers per stage)   stage costs ms")

    def on_step(step, run):
        if comm.rank:
            return
        bounds, costs = run.bounds[-1], np.array(run.layer_seconds[-1])
        sc = stage_costs(bounds, costs)
        print(f"{step:4d} {run.step_seconds[-1] * 1e3:8.1f} {step_time(sc, m) * 1e3:10.1f} "
              f"{bubble(sc, m):7.2f}  {str([b - a for a, b in bounds]):<30} {[round(c * 1e3) for c in sc]}",
              flush=True)

    run = train_pipeline_balanced(comm, cfg, batches, microbatches=m, optimizer="adamw", lr=0.01, slow=slow,
                                  every=2, window=1, on_step=on_step)
    full = gather_stage_states(comm, run)
    ok = True
    numbers = {}
    if comm.rank == 0:
        want, want_losses = train_serial(cfg, batches, lr=0.01, optimizer="adamw")
        diff = worst(max_state_diff(full, want), float(np.max(np.abs(np.subtract(run.losses, want_losses)))))
        ok = diff <= TOL
        for step, old, new, sent, secs in run.moves:
            print(f"re-partitioned after step {step}: {old} -> {new}: {sent} bytes of parameters and AdamW "
                  f"state moved point-to-point in {secs * 1e3:.1f} ms")
        if run.moves:
            k = run.moves[0][0]
            t = np.array(run.step_seconds)
            before = float(np.median(t[max(1, k - 1):k + 1]))
            after = float(np.median(t[k + 2:] if k + 2 < len(t) else t[k + 1:]))
            numbers = {"before": before, "after": after}
            print(f"step time: {before * 1e3:.1f} ms before the move, {after * 1e3:.1f} ms after "
                  f"(formula T = sum(c_s)/m + (m-1) max(c_s)/m, printed per step above)")
        else:
            print("no re-partition paid for itself in this run")
        print(f"serial twin: max |diff| {diff:.1e} over parameters and losses -> {'PASS' if ok else 'FAIL'}")
    return ok, numbers, run


def plot(path, dp_run, pp_run) -> None:
    """Step time beside the balanced time, each rank's share, and the pipeline's step time, per step."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 7), layout="constrained")  # the three titles clear of the axes above
    FigureCanvasAgg(fig)
    ax, ax2, ax3 = fig.subplots(3, 1)
    ax.plot(np.array(dp_run.step_seconds) * 1e3, "o-", label="DP step time")
    ax.plot(np.array(dp_run.ideal_seconds) * 1e3, "--", label="balanced B / sum(s_i)")
    ax.set_ylabel("step time (ms)")
    ax.set_title("data parallel: measured step vs the balanced optimum", fontsize=9)
    ax.legend()
    shares = np.array(dp_run.shares)
    for r in range(shares.shape[1]):
        ax2.plot(shares[:, r], "o-", label=f"rank {r}")
    ax2.set_ylabel("rows per rank")
    ax2.set_title("each rank's share of the batch", fontsize=9)
    ax2.legend(ncol=shares.shape[1])
    ax3.plot(np.array(pp_run.step_seconds) * 1e3, "o-", label="pipeline step time")
    for step, *_ in pp_run.moves:
        ax3.axvline(step + 0.5, color="gray", ls=":")
    ax3.set_ylabel("step time (ms)")
    ax3.set_title("pipeline: step time (dotted: a stage boundary moved)", fontsize=9)
    ax3.set_xlabel("training step")
    ax3.legend()
    fig.suptitle("a straggler appears, the shares follow throughput; a pipeline is re-cut")
    fig.savefig(path)


def rank_main(comm, args):
    if comm.size < 2:
        raise SystemExit("load_balancing needs at least 2 ranks (--ranks 2 or mpirun -n 2)")
    spec = args.slow if args.slow is not None else os.environ.get("MINIDIST_SLOW") or \
        f"rank={min(2, comm.size - 1)},factor=3,from_step=5"
    # default skew: the first two layers of stage 1 in the uniform cut, 4x heavier (one stage holds both)
    first = partition_uniform(pipeline_layers(comm.size), comm.size)[1][0]
    skew = args.skew if args.skew is not None else ";".join(f"layer={i},factor=4" for i in (first, first + 1))
    dp_slow = Slowdown([s for s in parse(spec) if s.rank is not None], pace=args.pace)
    pp_slow = Slowdown([s for s in parse(spec) + parse(skew) if s.layer is not None], pace=args.pace / 2)
    ok1, _, dp_run = data_parallel(comm, args, dp_slow)
    ok2, _, pp_run = pipeline(comm, args, pp_slow)
    if args.plot and comm.rank == 0:
        plot(args.plot, dp_run, pp_run)
        print(f"wrote {args.plot}")
    return finish(comm, ok1 and ok2)


def main(argv=None):
    parser = lesson_parser(__doc__.splitlines()[0], ranks=4)
    parser.add_argument("--slow", help="emulated slow rank, e.g. 'rank=2,factor=3,from_step=5' "
                                       "(default: $MINIDIST_SLOW, else that)")
    parser.add_argument("--skew", help="heavy pipeline layers, e.g. 'layer=2,factor=4;layer=3,factor=4'")
    parser.add_argument("--pace", type=float, default=0.008, help="emulated device seconds per row (0: off)")
    parser.add_argument("--batch", type=positive_int, default=48, help="global batch rows")
    parser.add_argument("--steps", type=positive_int, default=14, help="data-parallel steps")
    parser.add_argument("--pp-steps", type=positive_int, default=8, help="pipeline steps")
    parser.add_argument("--microbatches", type=positive_int, default=4)
    args = parser.parse_args(argv)
    if not args.pace >= 0:
        parser.error(f"argument --pace: must be seconds per row >= 0, got {args.pace}")
    for flag in (args.slow, args.skew):
        if flag:
            try:
                parse(flag)
            except ValueError as e:
                parser.error(str(e))
    if args.batch < world_size(args):
        parser.error(f"--batch {args.batch} must be at least the number of ranks ({world_size(args)})")
    launch(rank_main, args)


if __name__ == "__main__":
    from minidist.lessons.cli import run_lesson

    run_lesson(main)
