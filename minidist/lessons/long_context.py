"""Lesson 14: long context -- ring attention, zig-zag load balance, memory that falls as T/cp.

    mpirun -n 4 python -m minidist.lessons.long_context
    python -m minidist.lessons.long_context --ranks 4 [--seq 64] [--cp-mode ring|ulysses|hybrid] [--trace F]

The sequence is split over the cp ranks (all of them here). Rank 0 prints:

1. ring attention against serial attention (forward, dQ, dK, dV; float64): PASS;
2. a GPT trained over cp meshes (cp alone, dp x cp, cp x tp) against the serial GPT: PASS;
3. attention FLOPs per rank, contiguous chunks vs zig-zag (chunks r and 2cp-1-r), with the formulas;
4. the ledger's ring bytes beside 2(cp-1)·N forward and 2(cp-1)·N + 2·cp·N backward;
5. activation memory per rank vs T: serial attention keeps a T x T matrix per head, ring attention
   only per-token arrays, so each rank holds ~T/cp tokens' worth;
6. a timeline of one ring-attention forward and backward: F<j> / B<j> = attention on rank j's K/V
   block, while the next block is in flight (``--plot`` draws the transfers under the compute).

``--cp-mode ulysses`` adds Ulysses attention (two all-to-alls swap the split to the heads): a
4-head GPT with it against the serial GPT, and its bytes per rank beside the ring's and both formulas.
``--cp-mode hybrid``: the same with Ulysses inside pairs of ranks and the ring across the pairs.
"""

from __future__ import annotations

import contextlib

import numpy as np

from minidist import trace
from minidist.accel.backend import default_backend, set_default_backend, to_host
from minidist.autograd import ops
from minidist.autograd.tensor import Tensor
from minidist.comm import measure
from minidist.lessons.cli import finish, launch, lesson_parser, positive_int, rprint, world_size
from minidist.nn import GPT, GPTConfig
from minidist.nn.footprint import MemoryAccountant
from minidist.parallel.context.layout import shard_sequence, unshard_sequence
from minidist.parallel.context.model import context_parallel
from minidist.parallel.context.ring import AttentionStats, ring_attention, ring_bytes
from minidist.parallel.context.ulysses import ulysses_bytes
from minidist.parallel.context.usp import usp_bytes
from minidist.parallel.three_d import gather_full_state, max_state_diff, train_mesh, train_serial

TOL = 1e-10  # float64: only the summation order differs from the serial twin


@contextlib.contextmanager
def on_numpy():
    """Build and run the serial twins on NumPy, whatever the ranks' backend (section 1's reference is
    NumPy arrays too): an independent reference, and on JAX no programs compiled or loaded for
    shapes only a twin has, on rank 0 while the other ranks wait."""
    saved = default_backend()
    set_default_backend("numpy")
    try:
        yield
    finally:
        set_default_backend(saved)


def attention_check(comm, args):
    """Ring attention vs serial attention on random q, k, v; returns (max diff, FLOPs, bytes) on rank 0.
    The shapes are section 2's GPT attention's (batch 2, 2 heads of 8): on JAX, the same programs."""
    b, h, d, t = 2, 2, 8, args.seq
    rng = np.random.default_rng(args.seed)
    q, k, v, g = (rng.standard_normal((b, h, t, d)) for _ in range(4))
    stats = {}
    for layout in ("contiguous", "zigzag"):
        ts = [Tensor(shard_sequence(a, comm.rank, comm.size, layout, axis=2), requires_grad=True,
                     backend=default_backend())  # on the lesson's backend (CuPy won't mix in NumPy)
              for a in (q, k, v)]
        st = AttentionStats()
        with measure(comm) as fwd:
            out = ring_attention(*ts, comm, layout, stats=st)
        with measure(comm) as bwd:
            (out * Tensor(shard_sequence(g, comm.rank, comm.size, layout, axis=2),
                          backend=default_backend())).sum().backward()
        stats[layout] = (st, fwd.bytes_sent, bwd.bytes_sent, to_host(out.data), [to_host(x.grad) for x in ts])
    parts = comm.gather_obj(stats, root=0)
    if comm.rank != 0:
        return None
    ref = [Tensor(a, requires_grad=True) for a in (q, k, v)]
    want = ops.scaled_dot_product_attention(*ref, causal=True)
    (want * Tensor(g)).sum().backward()
    diff = 0.0
    for layout in ("contiguous", "zigzag"):
        got = unshard_sequence([p[layout][3] for p in parts], layout, axis=2)
        diff = max(diff, float(np.abs(got - want.data).max()))
        for i, x in enumerate(ref):
            got = unshard_sequence([p[layout][4][i] for p in parts], layout, axis=2)
            diff = max(diff, float(np.abs(got - x.grad).max()))
    n = b * h * (t // comm.size) * d
    return diff, {lay: [p[lay][0] for p in parts] for lay in stats}, \
        [(p["zigzag"][1], p["zigzag"][2]) for p in parts], n, (b, h, t // (2 * comm.size), d)


def gpt_check(comm, args, cfg):
    """Train the GPT over cp meshes; the largest parameter / loss difference to the serial twin."""
    rng = np.random.default_rng(args.seed)
    p = comm.size
    meshes = [dict(dp=1, cp=p, tp=1)]
    if p % 2 == 0 and p >= 4:
        meshes += [dict(dp=2, cp=p // 2, tp=1), dict(dp=1, cp=p // 2, tp=2)]
    rows = []
    for mesh in meshes:
        batches = [(rng.integers(0, cfg.vocab_size, (2 * mesh["dp"], args.seq)),
                    rng.integers(0, cfg.vocab_size, (2 * mesh["dp"], args.seq))) for _ in range(2)]
        res = train_mesh(comm, cfg, batches, lr=0.1, **mesh)
        state = gather_full_state(comm, res)
        if comm.rank == 0:
            with on_numpy():
                want, want_losses = train_serial(cfg, batches, lr=0.1)
            diff = max(max_state_diff(state, want), float(np.abs(np.subtract(res.losses, want_losses)).max()))
            rows.append((mesh, diff, res.mesh.draw()))
    return rows


ULYSSES_HEADS = 4  # the Ulysses section's GPT: cp (hybrid: the pair) must divide its heads
HYBRID_GROUP = 2   # --cp-mode hybrid: Ulysses inside pairs of ranks, the ring across the pairs


def ulysses_check(comm, args, cfg):
    """One forward + backward of a GPT with Ulysses (or hybrid) attention over all ranks vs the serial
    GPT: (max |diff| of loss and gradients, bytes sent by one attention layer's forward + backward) on
    rank 0; the attention layer's N = b·(T/cp)·H·D elements of q."""
    cfg = cfg.replace(n_head=ULYSSES_HEADS, n_layer=1)
    rng = np.random.default_rng(args.seed)
    x, y = rng.integers(0, cfg.vocab_size, (2, args.seq)), rng.integers(0, cfg.vocab_size, (2, args.seq))
    model = context_parallel(GPT(cfg), comm, mode=args.cp_mode,
                             ulysses_size=HYBRID_GROUP if args.cp_mode == "hybrid" else None)
    xs, ys = shard_sequence(x, comm.rank, comm.size), shard_sequence(y, comm.rank, comm.size)
    with measure(comm) as m:
        (ops.cross_entropy(model(xs), ys) * (1 / comm.size)).backward()  # equal shares of the mean
    loss = float(to_host(ops.cross_entropy(model(xs), ys).data)) / comm.size
    grads = {k: to_host(p.grad) for k, p in model.named_parameters()}
    parts = comm.gather_obj((loss, grads, m.bytes_sent), root=0)
    if comm.rank != 0:
        return None
    with on_numpy():
        serial = GPT(cfg)
        want = serial.loss(x, y)
        want.backward()
    diff = abs(sum(p[0] for p in parts) - float(want.data))
    for k, w in serial.named_parameters():
        diff = max(diff, float(np.abs(sum(p[1][k] for p in parts) - w.grad).max()))
    n = 2 * (args.seq // comm.size) * cfg.d_model
    return diff, [p[2] for p in parts], n


def peak_activations(model, t, cp=None):
    """Peak activation bytes of one forward of a batch of two length-``t`` sequences (section 2's
    batch: the same shapes, so on JAX the same compiled programs) through ``model``: a serial GPT
    (cp=None, this rank alone) or a context-parallel one over ``cp`` (this rank's tokens)."""
    x = np.zeros((2, t), np.int64)
    if cp is not None:
        x = shard_sequence(x, cp.rank, cp.size)
    acct = MemoryAccountant()
    with acct.track_activations(model):
        loss = ops.cross_entropy(model(x), x)
    loss.backward()
    model.zero_grad()  # (the next length's gradients are not added to these)
    return acct.peak_activation_bytes


def timeline(comm, args):
    """One ring-attention forward + backward under a tracer: every rank's events on rank 0."""
    b, h, d, t = 1, 4, 64, 512 * comm.size  # big enough blocks that compute shows against the transfers
    rng = np.random.default_rng(args.seed)
    ts = [Tensor(rng.standard_normal((b, h, t // comm.size, d)), requires_grad=True,
                 backend=default_backend()) for _ in range(3)]
    outer = trace.current()
    tracer = trace.Tracer(comm.rank)
    trace.set_current(tracer)
    try:
        comm.barrier()
        ring_attention(*ts, comm).sum().backward()
    finally:
        trace.set_current(outer)
    if outer is not None:
        outer.events.extend(tracer.events)
    return trace.gather_events(comm, tracer)


def rank_main(comm, args):
    p = comm.size
    cfg = GPTConfig(vocab_size=32, block_size=max(args.seq, 4 * p * 8), n_layer=2, n_head=2, d_model=16,
                    dtype="float64", seed=args.seed)
    rprint(comm, f"Long context over cp = {p} ranks: each holds {args.seq // p} of the {args.seq} tokens "
                 f"(zig-zag: rank r holds chunks r and {2 * p - 1}-r of {2 * p})\n")
    ok = True

    checked = attention_check(comm, args)
    rows = gpt_check(comm, args, cfg)
    if comm.rank == 0:
        diff, flops, sent, n, (b, h, c, d) = checked
        verdict = "PASS" if diff <= TOL else "FAIL"
        ok &= verdict == "PASS"
        print(f"1. ring attention vs serial attention (out, dQ, dK, dV; float64): max |diff| = {diff:.2e}  "
              f"{verdict}")
        print("\n2. GPT over cp meshes, 2 SGD steps, vs the serial GPT (parameters and losses, float64)")
        for mesh, gdiff, drawn in rows:
            verdict = "PASS" if gdiff <= TOL else "FAIL"
            ok &= verdict == "PASS"
            name = " x ".join(f"{k}={v}" for k, v in mesh.items() if v > 1 or k == "cp")
            print(f"   {name:<16} max |diff| = {gdiff:.2e}  {verdict}")
            print("\n".join("      ranks: " + line for line in drawn.splitlines()[1:]))
        print("   (rank = ((pp_rank·dp + dp_rank)·cp + cp_rank)·tp + tp_rank: '|' between cp ranks, "
              "'||' between dp replicas)")
        pair = 4 * b * h * c * c * d
        print("\n3. attention FLOPs per rank (forward; chunk pair = 4·b·h·c²·d = "
              f"{pair} FLOPs, c = T/2cp = {c})")
        print(f"   {'rank':>4}  {'contiguous':>11}  {'formula (4r+3)':>14}  {'zig-zag':>9}  "
              f"{'formula (2cp+1)':>15}")
        for r in range(p):
            con, zz = flops["contiguous"][r].forward_flops, flops["zigzag"][r].forward_flops
            print(f"   {r:>4}  {con:>11}  {(4 * r + 3) * pair:>14}  {zz:>9}  {(2 * p + 1) * pair:>15}")
            ok &= con == (4 * r + 3) * pair and zz == (2 * p + 1) * pair
        for lay in ("contiguous", "zigzag"):
            f = [s.forward_flops for s in flops[lay]]
            print(f"   {lay:>10}: slowest rank / mean = {max(f) / (sum(f) / len(f)):.2f}")
        want = ring_bytes(n, 8, p)
        print(f"\n4. ring bytes per rank (N = b·h·(T/cp)·d = {n} float64 per K or V block)")
        print(f"   forward  2(cp-1)·N·8 = {want['forward']:>7}   measured {sorted({s[0] for s in sent})}")
        print(f"   backward (2(cp-1) + 2cp)·N·8 = {want['backward']:>7}   "
              f"measured {sorted({s[1] for s in sent})}")
        good = all(s == (want["forward"], want["backward"]) for s in sent)
        ok &= good
        print(f"   {'PASS' if good else 'FAIL'}")

    rprint(comm, "\n5. activation memory per rank vs T (one forward's peak, bytes)")
    rprint(comm, f"   {'T':>5}  {'serial GPT':>11}  {'ring, per rank':>14}  {'serial / ring':>13}")
    lengths = [t for t in (2 * p * 4, 2 * p * 8, 2 * p * 16) if t <= cfg.block_size]
    ring_gpt = context_parallel(GPT(cfg), comm)  # one model per kind, every length through it
    with on_numpy():
        serial_gpt = GPT(cfg) if comm.rank == 0 else None
    for t in lengths:
        ring = comm.allgather_obj(peak_activations(ring_gpt, t, comm))
        if comm.rank == 0:
            with on_numpy():
                serial = peak_activations(serial_gpt, t)
            print(f"   {t:>5}  {serial:>11}  {max(ring):>14}  {serial / max(ring):>13.1f}")
    rprint(comm, "   the serial column grows like T² (softmax kept per head), the ring column like T/cp")

    if args.cp_mode != "ring":
        checked = ulysses_check(comm, args, cfg)
        if comm.rank == 0:
            diff, sent, n = checked
            hybrid = args.cp_mode == "hybrid"
            want = sum((usp_bytes(n, 8, HYBRID_GROUP, p // HYBRID_GROUP) if hybrid
                        else ulysses_bytes(n, 8, p)).values())
            good = diff <= TOL and all(s == want for s in sent)
            ok &= good
            how = (f"all-to-all in pairs, K/V round a ring of {p // HYBRID_GROUP} pairs" if hybrid
                   else "all-to-all q|k|v and the output")
            formula = "usp_bytes" if hybrid else "8(cp-1)/cp·N·8"
            print(f"\n5b. {args.cp_mode}: a {ULYSSES_HEADS}-head, 1-layer GPT over cp = {p} ({how}, forward "
                  f"and backward) vs the serial GPT: max |diff| = {diff:.2e}")
            ring = sum(ring_bytes(n, 8, p).values())
            print(f"   bytes per rank (N = b·(T/cp)·H·D = {n}): {formula} = {want} measured "
                  f"{sorted(set(sent))}; the ring would send (6cp-4)·N·8 = {ring}  "
                  f"{'PASS' if good else 'FAIL'}")

    events = timeline(comm, args)
    if comm.rank == 0:
        print("\n6. timeline of one ring-attention forward (F<j>: on rank j's K/V) and backward (B<j>)")
        compute = [e for e in events if e["cat"] == "compute"]
        print(trace.ascii_timeline_from_events(compute, width=96))
        flight = [e for e in events if e["cat"] == "send" and e["name"] == "K/V"]
        print(f"   {len(flight)} K/V transfers, each started before its block's compute and waited for after")
        if args.plot:
            trace.plot_timeline(args.plot, events, title=f"ring attention, cp={p}: K/V in flight")
            print(f"   wrote {args.plot}")
    return finish(comm, ok)


def main(argv=None):
    parser = lesson_parser(__doc__.split("\n")[0], ranks=4)
    parser.add_argument("--seq", type=positive_int, default=32,
                        help="sequence length (a multiple of 2·ranks)")
    parser.add_argument("--cp-mode", choices=["ring", "ulysses", "hybrid"], default="ring",
                        help="also check Ulysses attention (all-to-all to the heads and back), or the "
                             "hybrid: Ulysses in pairs of ranks, the ring across the pairs")
    args = parser.parse_args(argv)
    p = world_size(args)
    if args.seq % (2 * p):
        parser.error(f"--seq {args.seq} must be a multiple of 2 x ranks = {2 * p} (zig-zag chunks)")
    if args.cp_mode == "ulysses" and ULYSSES_HEADS % p:
        parser.error(f"argument --cp-mode: ulysses splits the GPT's {ULYSSES_HEADS} attention heads over "
                     f"cp = {p} ranks; use --ranks 1, 2 or 4, or --cp-mode ring")
    if args.cp_mode == "hybrid" and p % HYBRID_GROUP:
        parser.error(f"argument --cp-mode: hybrid groups the ranks in pairs; use an even --ranks, got {p}")
    launch(rank_main, args)


if __name__ == "__main__":
    from minidist.lessons.cli import run_lesson

    run_lesson(main)
