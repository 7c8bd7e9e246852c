"""Lesson 12's curves: the bytes each method sent to reach dense's loss, printed and plotted.

``train`` (``minidist.lessons.compression``) evaluates rank 0's replica on held-out windows every few
steps; each evaluation is (step, bytes sent so far, loss). ``bytes_at_dense_loss`` finds where each
method's curve first enters a band around dense's final loss and divides dense's bytes by the
method's: the byte ratio at equal loss. ``plot`` draws loss vs step and loss vs cumulative bytes on a
log axis with that band, so the ratio can be read off the picture as well.
"""

from __future__ import annotations

import numpy as np

BAND = 0.02   # "at dense loss": within 2% of dense's final held-out loss


def curve(r):
    """(steps, cumulative MB sent by rank 0, held-out loss of rank 0's replica) at each evaluation,
    only where something has been sent: DiLoCo sends nothing for its first H-1 steps, and a log axis
    has no place for 0 bytes."""
    steps, sent, loss = (np.array(c, dtype=float) for c in zip(*r["evals"]))
    keep = sent > 0
    return steps[keep], sent[keep] / 1e6, loss[keep]


def mb_to_reach(r, level: float):
    """MB rank 0 had sent when its held-out loss first came down to ``level`` (None: never)."""
    _, mb, loss = curve(r)
    hit = np.nonzero(loss <= level)[0]
    return float(mb[hit[0]]) if len(hit) else None


def bytes_at_dense_loss(results: list) -> tuple[float, list]:
    """The loss level (dense's final held-out loss + BAND) and per method (name, MB to reach it,
    dense's MB / that): the byte ratio at equal loss, where the plot's band meets each curve."""
    level = float(curve(results[0])[2][-1]) * (1 + BAND)
    base = mb_to_reach(results[0], level)
    rows = []
    for r in results:
        mb = mb_to_reach(r, level)
        rows.append((r["name"], mb, None if mb is None or base is None else base / mb))
    return level, rows


def print_bytes_at_dense_loss(comm, results: list) -> None:
    """Rank 0 (which holds the evaluations): the MB each method sent to reach dense's loss."""
    if comm.rank != 0:
        return
    level, rows = bytes_at_dense_loss(results)
    print(f"\nMB rank 0 sent until its held-out loss reached dense's final + {BAND:.0%} ({level:.4f}; "
          "--plot's right panel, where each curve enters the band):", flush=True)
    for name, mb, ratio in rows:
        got = "not reached in these steps" if mb is None else f"{mb:8.3f} MB = 1/{ratio:.1f} of dense's bytes"
        print(f"  {name:<18} {got}", flush=True)


STYLES = ["-", "--", "-.", ":"]


def plot(path, results):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    level, _ = bytes_at_dense_loss(results)
    fig, (ax_s, ax_b) = plt.subplots(1, 2, figsize=(13, 5))
    for i, r in enumerate(results):
        style = dict(color=f"C{i % 10}", ls=STYLES[i // 3 % len(STYLES)] if i else "-",
                     lw=2.5 if i == 0 else 1.5, marker="o", markersize=3)
        steps, mb, loss = curve(r)
        ax_s.plot(steps, loss, label=r["name"], **style)
        ax_b.plot(mb, loss, label=r["name"], **style)
    for ax in (ax_s, ax_b):
        ax.axhspan(level / (1 + BAND) * (1 - BAND), level, color="0.85", zorder=0,
                   label=f"dense's final loss ± {BAND:.0%}")
        ax.set_ylabel("held-out loss, nats/token (rank 0's replica)")
        ax.grid(alpha=0.3)
    ax_s.set(xlabel="training step", title="loss vs step: the same batches for every method")
    ax_b.set(xlabel="cumulative MB sent by rank 0 (log scale; 1 MB = 1e6 bytes)", xscale="log",
             title="loss vs bytes: where each curve enters the band, vs dense")
    ax_b.legend(fontsize=8, loc="upper right")
    fig.suptitle(f"Gradient compression: {len(results)} methods, the same GPT and batches "
                 "(bytes: rank 0's ledger)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
