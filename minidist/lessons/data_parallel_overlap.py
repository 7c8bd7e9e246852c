"""Lesson 3, section 2: DDP's bucket all-reduces overlapping backward, on a text timeline and ``--plot``.

One timed DDP step (after a warm-up) of a GPT big enough for overlap to show; each rank's share of
all-reduce time hidden behind its backward (``minidist.trace.hidden_fraction``); two rows per rank:
backward, and the buckets in the order backward completes them.
"""

from __future__ import annotations

import string

import numpy as np

from minidist.nn import GPT
from minidist.parallel.data.ddp import DDP
from minidist.parallel.data.zero import param_count
from minidist.trace import hidden_fraction, plot_timeline


def overlap_step(comm, args, cfg):
    """One timed DDP step (after a warm-up step) of a GPT big enough for overlap to show: section 1's
    model has a backward of a few ms, no longer than the all-reduces it should hide. Equal slices and
    no accumulation, so every rank's backward is the same work."""
    cfg = cfg.replace(d_model=args.overlap_d_model, n_layer=args.overlap_layers, dtype="float32")
    m = GPT(cfg)
    ddp = DDP(m, comm, bucket_bytes=args.overlap_bucket_kb * 1024)
    rng = np.random.default_rng(args.seed + comm.rank)
    for _ in range(2):
        x = rng.integers(0, 64, (args.overlap_rows, args.seq))
        ddp.backward(m.loss(x, x), n_samples=len(x))
        ddp.wait_gradients()
        m.zero_grad()
    return ddp, param_count(m)


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
    every rank's events on rank 0 (None elsewhere), for ``plot``."""
    ddp, psi = overlap_step(comm, args, cfg)
    events = comm.gather_obj(ddp.events)
    if comm.rank == 0:
        hidden = [hidden_fraction(e) for e in events]
        nb = len(ddp.buckets)
        last = SYMBOLS[(nb - 1) % len(SYMBOLS)]
        legend = f"{SYMBOLS[0]}..{last}" + (" (letters repeat)" if nb > len(SYMBOLS) else "")
        print(f"2. Overlap: one DDP step of a bigger GPT (d_model={args.overlap_d_model}, "
              f"{args.overlap_layers} layers, Ψ = {psi:,} float32, {args.overlap_rows} rows per rank): "
              f"{nb} buckets of <= {args.overlap_bucket_kb} KiB, {ddp.started_in_backward} started from "
              "backward hooks")
        print("   share of all-reduce time hidden behind backward, per rank: "
              + ", ".join(f"{h:.0%}" for h in hidden))
        print(f"   {legend} = buckets 0, 1, ... in the order backward completes them "
              f"({SYMBOLS[0]}: the head and last layer)")
        print(timeline(events))
        print()
    return events


def plot(path, events) -> None:
    """The timeline of section 2: backward and the bucket all-reduces of every rank, in ms."""
    back = {"name": "Backward", "cat": "compute"}  # plot_timeline shades names starting with B
    evs = [{"name": n, "cat": "collective", "rank": r, "t0": a, "t1": b}
           | (back if k == "backward" else {}) for r, e in enumerate(events) for n, k, a, b in e]
    plot_timeline(path, evs, ms=True,
                  title=f"one DDP step on {len(events)} ranks: backward and the bucket all-reduces beside it")
    print(f"wrote {path}")
