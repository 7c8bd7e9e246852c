"""Lesson 3, section 2: DDP's bucket all-reduces overlapping backward, on a text timeline and ``--plot``.

One timed DDP step (after a warm-up) of a GPT big enough for overlap to show; each rank's share of
all-reduce time hidden behind its backward (``minidist.trace.hidden_fraction``), from DDP's own
record of the step and again from the trace's spans (they must agree); on the virtual clock each
bucket's time beside the link's alpha-beta time of its all-reduce; two rows per rank: backward, and
the buckets in the order backward completes them.
"""

from __future__ import annotations

import string

import numpy as np

from minidist import trace
from minidist.comm import cost
from minidist.nn import GPT
from minidist.parallel.data.ddp import DDP
from minidist.parallel.data.zero import param_count
from minidist.trace import hidden_fraction, plot_timeline

AGREE = 0.02  # DDP's record and the trace's spans, on the virtual clock: a few Python lines apart
# (on the wall clock a loaded machine may preempt the thread between the two reads: no verdict there)


def overlap_step(comm, args, cfg, tracer=None):
    """One timed DDP step (after a warm-up step) of a GPT big enough for overlap to show: section 1's
    model has a backward of a few ms, no longer than the all-reduces it should hide. Equal slices and
    no accumulation, so every rank's backward is the same work."""
    cfg = cfg.replace(d_model=args.overlap_d_model, n_layer=args.overlap_layers, dtype="float32")
    m = GPT(cfg)
    ddp = DDP(m, comm, bucket_bytes=args.overlap_bucket_kb * 1024)
    rng = np.random.default_rng(args.seed + comm.rank)
    since = 0.0
    for _ in range(2):
        x = rng.integers(0, 64, (args.overlap_rows, args.seq))
        since = tracer.instant("section 2: the timed DDP step").get("t0") if tracer is not None else 0.0
        ddp.backward(m.loss(x, x), n_samples=len(x))
        ddp.wait_gradients()
        m.zero_grad()
    return ddp, param_count(m), since


def traced_hidden(spans) -> float:
    """The hidden share again, from a trace's spans: DDP's "backward" compute span and its bucket
    collectives ("all-reduce b0", ...), as a reader of the Chrome trace would measure it."""
    mine = [e for e in spans if e["name"] == "backward" or e["name"].startswith("all-reduce b")]
    return hidden_fraction([(e["name"], "backward" if e["name"] == "backward" else "comm", e["t0"], e["t1"])
                            for e in mine])


def link_line(comm, ddp, events) -> str:
    """Virtual clock: what the buckets cost on the link by the alpha-beta model (each bucket's
    all-reduce by the algorithm auto chose, ``Link.predict_all_reduce``) beside rank 0's backward."""
    link, p = comm.clock.link, comm.size
    total = 0.0
    for b in ddp.buckets:
        nbytes = b.numel * np.dtype(b.dtype).itemsize
        total += link.predict_all_reduce(cost.choose_algorithm(nbytes, p, comm.agreed_crowded), nbytes, p)
    back = sum(t1 - t0 for _, kind, t0, t1 in events[0] if kind == "backward")
    return (f"   on the clock: the {len(ddp.buckets)} buckets' all-reduces cost {total * 1e3:.2f} ms on the "
            f"link (alpha-beta), rank 0's backward {back * 1e3:.2f} ms")


SYMBOLS = string.ascii_letters  # bucket i is drawn as SYMBOLS[i % 52]


def timeline(events_by_rank, width=64) -> str:
    """Two rows per rank: backward ('B') and the bucket collectives (bucket i as letter ``SYMBOLS[i]``:
    a, b, c, ... then A, B, C, ...; digits would be ambiguous past 10 buckets)."""
    allev = [e for evs in events_by_rank for e in evs]
    t0 = min(e[2] for e in allev)
    span = max(e[3] for e in allev) - t0 or 1.0
    rows = []
    for r, evs in enumerate(events_by_rank):
        for kind, label in (("backward", "backward"), ("comm", "buckets ")):
            row = ["."] * width
            for name, k, a, b in evs:
                if k != kind:
                    continue
                c0 = int((a - t0) / span * width)
                c1 = max(int((b - t0) / span * width), c0 + 1)
                ch = "B" if kind == "backward" else SYMBOLS[int(name.split(" b")[-1]) % len(SYMBOLS)]
                for c in range(c0, min(c1, width)):
                    row[c] = ch
            rows.append(f"rank {r} {label} |{''.join(row)}|")
    return "\n".join(rows)


def show_overlap(comm, args, cfg):
    """Section 2 with section 1's GPT ``cfg`` made bigger (every rank takes part; rank 0 prints); returns
    every rank's events on rank 0 (None elsewhere), for ``plot``, and whether the trace agreed."""
    tracer = trace.current() or trace.Tracer(comm.rank)  # --trace's, or one for this section
    with trace.tracing(tracer):
        ddp, psi, since = overlap_step(comm, args, cfg, tracer)
    events = comm.gather_obj(ddp.events)
    from_trace = comm.gather_obj(traced_hidden([e for e in tracer.events if e["t0"] >= since]))
    ok = True
    if comm.rank == 0:
        hidden = [hidden_fraction(e) for e in events]
        ok = all(abs(a - b) <= AGREE for a, b in zip(hidden, from_trace)) or comm.clock is None
        nb = len(ddp.buckets)
        last = SYMBOLS[(nb - 1) % len(SYMBOLS)]
        legend = f"{SYMBOLS[0]}..{last}" + (" (letters repeat)" if nb > len(SYMBOLS) else "")
        print(f"2. Overlap: one DDP step of a bigger GPT (d_model={args.overlap_d_model}, "
              f"{args.overlap_layers} layers, Ψ = {psi:,} float32, {args.overlap_rows} rows per rank): "
              f"{nb} buckets of <= {args.overlap_bucket_kb} KiB, {ddp.started_in_backward} started from "
              "backward hooks" + (" -- on the virtual clock" if comm.clock is not None else ""))
        print("   share of all-reduce time hidden behind backward, per rank: "
              + ", ".join(f"{h:.0%}" for h in hidden))
        print("   the same from the trace's spans (backward, all-reduce b*):    "
              + ", ".join(f"{h:.0%}" for h in from_trace)
              + (f"  {'PASS' if ok else 'FAIL'}" if comm.clock is not None else ""))
        if comm.clock is not None:
            print(link_line(comm, ddp, events))
        print(f"   {legend} = buckets 0, 1, ... in the order backward completes them "
              f"({SYMBOLS[0]}: the head and last layer)")
        print(timeline(events))
        print()
    return events, ok


def plot(path, events) -> None:
    """The timeline of section 2: backward and the bucket all-reduces of every rank, in ms."""
    back = {"name": "Backward", "cat": "compute"}  # plot_timeline shades names starting with B
    evs = [{"name": n, "cat": "collective", "rank": r, "t0": a, "t1": b}
           | (back if k == "backward" else {}) for r, e in enumerate(events) for n, k, a, b in e]
    plot_timeline(path, evs, ms=True,
                  title=f"one DDP step on {len(events)} ranks: backward and the bucket all-reduces beside it")
    print(f"wrote {path}")
