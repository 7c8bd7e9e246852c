"""Lesson 4: tensor parallelism -- one GPT's layers split across ranks, Megatron-LM style.

    python -m minidist.lessons.tensor_parallel --ranks 4      # ranks as threads
    mpirun -n 4 python -m minidist.lessons.tensor_parallel    # ranks as MPI processes

A small GPT is trained for a few steps with tp = 1, 2, 4 (sequence parallelism off and on) and
checked against its serial twin, step by step (tolerances derived in ``tensor_parallel_tolerance``:
``rounding_bound``, ``adamw_tolerance``; float32 sums the ranks' partial products in another order). Then one
transformer layer's communication (forward + backward) is measured by the ledger beside Megatron's
formula, and each rank's parameter and activation bytes beside 1/tp of the serial model's.

``--overlap``: the sequence-parallel runs use collective matmul (``use_collective_matmul``: each
all-gather / reduce-scatter decomposed into ring hops hidden behind the GEMM chunks); the ledger
shows the same bytes, and one layer under an emulated ``--link`` shows the share of its hops that
ran during its GEMMs, with a two-lane timeline. On the virtual clock (``--clock virtual``, best with
``--device h100``) ``tensor_parallel_overlap`` then finds where collective matmul starts to beat the
unfused layer as the link slows, against the crossover h* = (p·c - C)/(p-1).
"""

from __future__ import annotations

import numpy as np

from minidist import trace
from minidist.accel.backend import default_backend, to_host
from minidist.autograd import random as mrandom
from minidist.autograd.tensor import Tensor
from minidist.comm import measure
from minidist.comm.cost import all_reduce_bytes_sent
from minidist.comm.transports.link import parse_link
from minidist.lessons.cli import (
    finish,
    launch,
    lesson_parser,
    link_spec,
    positive_float,
    positive_int,
    probability,
    rprint,
)
from minidist.lessons.tensor_parallel_overlap import cm_crossover
from minidist.lessons.tensor_parallel_tolerance import compare, first_gradients, rounding_bound
from minidist.lessons.this_machine import compare_line, ms, this_machine
from minidist.nn import GPT, GPTConfig, optim
from minidist.nn.data import BatchLoader, TextDataset
from minidist.nn.footprint import MemoryAccountant
from minidist.nn.serial import adamw_tolerance, train_steps
from minidist.parallel.tensor.collective_matmul import CHANNEL, hidden_share, lanes, use_collective_matmul
from minidist.parallel.tensor.gpt import TPGPT, ParallelBlock
from minidist.parallel.tensor.sharding import serial_state_dict, sharding_table, unshard
from minidist.trace.clock import now


def make_batches(args, block_size):
    loader = BatchLoader(TextDataset.from_file(block_size=block_size), batch_size=args.batch, seed=args.seed)
    return [loader.next_batch() for _ in range(args.steps)]


def train(model, batches, lr):
    """AdamW steps (no weight decay), the serial twin's loop; returns the losses."""
    return train_steps(model, batches, optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0))


def activation_bytes(model, idx, tgt) -> int:
    """Peak bytes saved for backward by one forward pass (parameters excluded): the memory accountant's."""
    acct = MemoryAccountant()
    with acct.track_activations(model):
        model.loss(idx, tgt)  # the peak is reached at the end of forward, before the graph is dropped
    return acct.peak_activation_bytes


def layer_traffic(group, cfg, b, s, sp, overlap=False, tracer=None):
    """One ParallelBlock forward + backward: this rank's ledger (bytes sent, calls in order).
    ``overlap``: with collective matmul (its hops are point-to-point, no collective calls)."""
    block = ParallelBlock(cfg, group, np.random.default_rng(0), sequence_parallel=sp)
    if overlap and sp:
        use_collective_matmul(block)
    t = s // group.size if sp else s
    x = Tensor(np.random.default_rng(1).standard_normal((b, t, cfg.d_model)).astype(cfg.dtype),
               requires_grad=True, backend=default_backend())  # beside the block's weights (CuPy mixes none)
    with measure(group) as m, trace.tracing(tracer):
        block(x).sum().backward()
    return m


OVERLAP_LINK = "alpha_us=50,gbps=2"  # --overlap's timeline without --link: on its own channels only


def overlap_link(args):
    """The link of --overlap's runs: --link's, or OVERLAP_LINK."""
    return parse_link(link_spec(args.link) if args.link else OVERLAP_LINK)


def overlap_timeline(comm, cfg, args):
    """One sequence-parallel layer with collective matmul, every hop on the emulated ``--link``
    (the group and its channels get it): rank 0's hidden share and two-lane timeline."""
    tp = 2 if comm.size >= 2 else 1
    group = comm.split(0 if comm.rank < tp else None, comm.rank)
    if group is None or tp == 1:
        return
    link = overlap_link(args)
    for ch in (group, group.channel("async"), group.channel(CHANNEL)):
        ch.link = link
    saved = group.clock.link if group.clock is not None else None
    if saved is not None:  # the virtual clock charges the same link (and needs no thread to wait)
        group.clock.link = link
    big = cfg.replace(d_model=512)  # GEMM chunks long enough to hide a hop behind
    tracer = trace.Tracer(group.rank)
    layer_traffic(group, big, args.batch, 256, True, overlap=True, tracer=tracer)
    if saved is not None:
        group.clock.link = saved
    if group.rank == 0:
        print(f"\ncollective matmul, one layer (h=512, s=256) on tp=2 over link {link}: "
              f"{hidden_share(tracer.events):.0%} of the hops' link time ran during a GEMM chunk")
        print(lanes(tracer.events))


def rank_main(comm, args):
    cfg = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=4, d_model=args.d_model,
                    dropout=args.dropout, seed=args.seed)
    b, s, h, itemsize = args.batch, args.seq, cfg.d_model, np.dtype(cfg.dtype).itemsize
    tps = [tp for tp in (1, 2, 4) if tp <= comm.size]
    batches = make_batches(args, cfg.block_size)
    rprint(comm, f"GPT: {cfg.n_layer} layers, h={h}, {cfg.n_head} heads, vocab {cfg.vocab_size}; "
                 f"batch b={b}, sequence s={s}; {args.steps} AdamW steps; "
                 f"world {comm.size} ({comm.transport})\n")

    rel = args.tol or rounding_bound(b, s, h, cfg.vocab_size, cfg.dtype)
    param_tol = adamw_tolerance(args.lr, args.steps)
    twin = None
    if comm.rank == 0:  # the serial twin
        serial = GPT(cfg)
        loss0, grads = first_gradients(serial, batches[0], args.seed)
        mrandom.manual_seed(args.seed)
        losses = train(serial, batches, args.lr)
        twin = dict(loss0=loss0, grads=grads, losses=losses,
                    params={k: to_host(v) for k, v in serial.state_dict().items()})
        serial_act = activation_bytes(serial, *batches[0])
        serial_param_bytes = sum(p.data.nbytes for p in serial.parameters())
        rprint(comm, f"serial twin: loss {losses[0]:.4f} -> {losses[-1]:.4f}\n")
    rprint(comm, f"{'tp':>3} {'seq-par':>7} {'final loss':>10} {'max|dloss|':>11} {'max|dgrad|':>11} "
                 f"{'max|dparam|':>12} {'check':>5} {'params/rank':>12} {'serial/tp':>10} "
                 f"{'activ./rank':>12} {'serial/tp':>10} {'step ms':>8}")
    rows, passed = [], True
    for tp in tps:
        group = comm.split(0 if comm.rank < tp else None, comm.rank)
        for sp in ((False, True) if tp > 1 else (False,)):
            if group is None:
                continue
            model = TPGPT(cfg, group, sequence_parallel=sp, dropout_rng=args.dropout_rng)
            if sp and args.overlap:
                use_collective_matmul(model)
            loss0, grads = first_gradients(model, batches[0], args.seed)
            grads = unshard(group.allgather_obj(grads), sharding_table(model))
            mrandom.manual_seed(args.seed)
            t0 = now()  # the rank's virtual time on the virtual clock, else wall time
            losses = train(model, batches, args.lr)
            step_ms = max(group.allgather_obj(now() - t0)) / len(batches) * 1e3
            full = serial_state_dict(model)
            act = activation_bytes(model, *batches[0])
            pbytes = sum(p.data.nbytes for p in model.parameters())
            if comm.rank == 0:
                ok, dl, dg, dp = compare(twin, dict(loss0=loss0, grads=grads, losses=losses, params=full),
                                         rel, param_tol)
                passed &= ok
                rows.append((tp, sp, ok, pbytes, act, serial_param_bytes, serial_act, step_ms / 1e3))
                rprint(comm, f"{tp:>3} {('cm' if args.overlap else 'on') if sp else 'off':>7} "
                             f"{losses[-1]:>10.4f} {dl:>11.2e} "
                             f"{dg:>11.2e} {dp:>12.2e} {'PASS' if ok else 'FAIL':>5} {pbytes:>12,} "
                             f"{serial_param_bytes // tp:>10,} "
                             f"{act:>12,} {serial_act // tp:>10,} {step_ms:>8.1f}")
    rprint(comm, f"(the ranks sum partial products in another order than the twin, {cfg.dtype}: the first\n"
                 f" gradients (max|dgrad|, relative to each tensor's max|g|) and every step's loss within\n"
                 f" {rel:.1e} of their size -- 2u·sqrt(b·s·max(4h, vocab)), rounding_bound; the parameters\n"
                 f" after {args.steps} AdamW steps within 0.1·lr·steps = {param_tol:.1e}, adamw_tolerance;\n"
                 " step ms: measured per AdamW step, the slowest rank's)\n")
    hw = this_machine(comm.transport)
    for tp, sp, *_, step_s in rows:  # the planner's two models beside each measured step (chapter 11)
        if not sp and comm.clock is not None:
            rprint(comm, f"TP step, tp={tp}: {ms(step_s)} on the virtual clock (each rank's compute "
                         + (f"on {comm.clock.device.name})" if comm.clock.device else "in its own CPU time)"))
        elif not sp:
            rprint(comm, compare_line(f"TP step, tp={tp}", step_s, tp, hw, n_layer=args.layers, d_model=h,
                                      n_head=4, vocab=cfg.vocab_size, seq=s, batch=b, tp=tp))
    shared = "" if comm.clock is not None else ", and where the ranks share the cores their work takes turns"
    rprint(comm, "(a tiny model split tp ways is slower, not faster: the all-reduces and per-op overheads\n"
                 f" do not shrink with tp{shared})\n")
    rprint(comm, "Parameters shrink ~1/tp (LayerNorms and position table stay replicated). Without sequence\n"
                 "parallelism LayerNorm, dropout and residual activations are replicated on every rank, so\n"
                 "activations do not shrink 1/tp; with it they are sequence shards.\n")

    rprint(comm, f"One transformer layer, forward + backward, b·s·h = {b}·{s}·{h} float32 = "
                 f"N = {b * s * h * itemsize:,} bytes:")
    rprint(comm, f"{'tp':>3} {'seq-par':>7} {'sent/rank':>10} {'formula 4·2(p-1)/p·N':>21} {'check':>5}  "
                 "collectives in order (activations)")
    N = b * s * h * itemsize
    for tp in tps[1:]:
        group = comm.split(0 if comm.rank < tp else None, comm.rank)
        for sp in (False, True):
            if group is None:
                continue
            m = layer_traffic(group, cfg, b, s, sp, overlap=args.overlap)
            big = [c for c in m.calls if not (sp and c.name == "ring_all_reduce")]  # activations
            sent = sum(c.bytes_sent for c in big)
            if sp and args.overlap:  # collective matmul: hops, not calls; the rest is LayerNorm/bias
                sent = m.bytes_sent - sum(c.bytes_sent for c in m.calls)
            want = 4 * all_reduce_bytes_sent("ring", N, tp, group.rank)  # 4 all-reduces (or RS + AG)
            names = " ".join({"ring_all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS"}[c.name]
                             for c in big) or "CM: 8 rings of collective matmul hops"
            small = m.bytes_sent - sent
            passed &= sent == want  # rank 0's verdict is the lesson's (finish)
            mode = ("cm" if args.overlap else "on") if sp else "off"
            rprint(comm, f"{tp:>3} {mode:>7} {sent:>10,} {want:>21,} "
                         f"{'PASS' if sent == want else 'FAIL':>5}  {names}"
                         + (f"  (+{small:,} B: LayerNorm/bias grads)" if small else ""))
    rprint(comm, "AR = all-reduce (2(p-1)/p·N), AG = all-gather and RS = reduce-scatter ((p-1)/p·N each):\n"
                 "forward: attention g, MLP g; backward: MLP f, attention f. Sequence parallelism turns\n"
                 "each all-reduce into RS + AG -- the same bytes, with LayerNorm/dropout on 1/tp of the\n"
                 "tokens.")
    if args.overlap:
        overlap_timeline(comm, cfg, args)
        if comm.clock is not None:  # when collective matmul pays: the crossover, derived and checked
            passed &= cm_crossover(comm, overlap_link(args))
    if args.plot and comm.rank == 0:
        plot(args.plot, rows)
    return finish(comm, passed)


def plot(path, rows):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"tp={r[0]}{' sp' if r[1] else ''}" for r in rows]
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r[3] / 1e6 for r in rows], 0.4, label="parameters / rank")
    ax.bar(x + 0.2, [r[4] / 1e6 for r in rows], 0.4, label="activations / rank")
    ax.plot(x - 0.2, [r[5] / r[0] / 1e6 for r in rows], "k_", markersize=20,
            label="serial / tp (an even split)")
    ax.plot(x + 0.2, [r[6] / r[0] / 1e6 for r in rows], "k_", markersize=20)
    ax.set_xticks(x, labels)
    ax.set_xlabel("tensor-parallel degree (sp: with sequence parallelism)")
    ax.set_ylabel("bytes per rank (MB = 1e6 bytes)")
    ax.set_title("memory per rank under tensor parallelism: measured vs an even split", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}", flush=True)


def main(argv=None):
    parser = lesson_parser(__doc__, ranks=4)
    parser.add_argument("--steps", type=positive_int, default=10)
    parser.add_argument("--batch", type=positive_int, default=4)
    parser.add_argument("--seq", type=positive_int, default=32, help="a multiple of 4 (sequence parallel)")
    parser.add_argument("--d-model", type=positive_int, default=64, help="a multiple of the 4 heads")
    parser.add_argument("--layers", type=positive_int, default=2)
    parser.add_argument("--dropout", type=probability, default=0.1)
    parser.add_argument("--dropout-rng", choices=["serial", "megatron"], default="serial",
                        help="sharded-region dropout masks: slices of the serial mask, or per-rank streams")
    parser.add_argument("--lr", type=positive_float, default=3e-3)
    parser.add_argument("--tol", type=positive_float, default=None,
                        help="relative tolerance of gradients and losses (default: rounding_bound, "
                             "2.2e-05 for float32 at the default sizes)")
    parser.add_argument("--overlap", action="store_true",
                        help="sequence parallelism with collective matmul (hops hidden behind the GEMMs)")
    args = parser.parse_args(argv)  # --link (every message's; default: --overlap's own OVERLAP_LINK)
    try:
        link_spec(args.link) if args.link else None
    except ValueError as e:
        parser.error(f"argument --link: {e}")
    if args.d_model % 4:
        parser.error(f"argument --d-model: must be a multiple of the 4 attention heads, got {args.d_model}")
    if args.seq % 4:
        parser.error(f"argument --seq: sequence parallelism splits it over up to 4 ranks: use a multiple "
                     f"of 4, got {args.seq}")
    launch(rank_main, args)


if __name__ == "__main__":
    from minidist.lessons.cli import run_lesson

    run_lesson(main)
