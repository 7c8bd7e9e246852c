"""What `python -m minidist.plan` prints and draws: the ranked table, memory by kind, the step's parts.

`table` -- one row per mesh (m: microbatches per replica per step, `mbsize` in the label: sequences
in each, as the lessons name them), why each loses to the first, and under it how #1 runs and, when
its bubble is not the textbook (p-1)/(m+p-1), why (`Prediction.bubble_why`). `plot` -- memory per
device by kind beside the step's time by part.
"""

from __future__ import annotations

from minidist.plan.mesh import KINDS
from minidist.plan.steptime import axis_link


def human(nbytes: float) -> str:
    """Bytes in the unit that suits them: 1.5 GB, 840 kB."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{nbytes:.0f} B"


def links(cand, hw) -> str:
    """Which link each of the candidate's axes runs on (minidist.plan.steptime.axis_link)."""
    parts = []
    for ax in ("tp", "cp", "ep", "dp", "pp"):
        size = getattr(cand, ax)
        if size > 1:
            inner, _, outer, q = axis_link(hw, cand, ax)
            across = f" then {outer.name} ({q} groups)" if outer and q > 1 else ""
            parts.append(f"{ax} on {inner.name}{across}")
    return ", ".join(parts) or "one chip: no links"


def table(preds, top: int, batch: int | None = None, hw=None) -> str:
    head = (f"{'#':>2} {'mesh':<48} {'m':>4} {'memory':>8} fit {'step s':>8} {'compute':>8} {'tp':>7} "
            f"{'dp':>7} {'pp':>7} {'cp+ep':>7} {'bubble':>7} {'MFU':>5} {'tok/s':>9}  why not first")
    lines = [head]
    for i, p in enumerate(preds[:top]):
        c = p.comm
        fit = "yes" if p.fits else "NO "
        lines.append(f"{i + 1:>2} {p.cand.label():<48} {p.microbatches:>4} {human(p.memory['total']):>8} "
                     f"{fit:>3} "
                     f"{p.step:>8.3g} {p.compute:>8.3g} {c.get('tp', 0):>7.2g} {c.get('dp', 0):>7.2g} "
                     f"{c.get('pp', 0):>7.2g} {c.get('cp', 0) + c.get('ep', 0):>7.2g} "
                     f"{p.bubble_fraction:>6.1%} {p.mfu:>5.1%} "
                     f"{p.tokens_per_s:>9.3g}  "
                     f"{p.reason}")
    best = preds[0]
    if batch is not None:
        m = best.cand.microbatches(batch)
        size = best.cand.microbatch_size
        lines.append(f"#1 runs m = {m} microbatch{'es' if m != 1 else ''} of {size} "
                     f"sequence{'s' if size != 1 else ''} per replica (m: the lessons' --microbatches, "
                     f"mbsize: sequences in each); {links(best.cand, hw)}")
    if best.bubble_why:
        lines.append(f"#1 {best.bubble_why}")
    lines.append("memory per device by kind (the fullest pipeline stage):")
    lines.append(f"{'#':>2} {'':<48} " + " ".join(f"{k:>11}" for k in KINDS))
    for i, p in enumerate(preds[:top]):
        kinds = " ".join(f"{human(p.memory[k]):>11}" for k in KINDS)
        lines.append(f"{i + 1:>2} {p.cand.label():<48} {kinds}")
    return "\n".join(lines)


def _stacked(ax, labels, parts, preds, unit: float):
    """Horizontal stacked bars, one series per (name, value-of-prediction); all-zero series left out."""
    left = [0.0] * len(preds)
    for name, f in parts:
        vals = [f(p) / unit for p in preds]
        if any(vals):
            ax.barh(labels, vals, left=left, label=name)
            left = [x + y for x, y in zip(left, vals)]
    ax.legend(loc="lower right", fontsize=8, framealpha=0.8)
    ax.invert_yaxis()


def plot(preds, path: str, top: int, capacity: float | None = None) -> None:
    """Memory per device by kind (left, with the device's `capacity` as a line) and the step's time by
    part (right), for the `top` best."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    preds = preds[:top]
    labels = [p.cand.label().replace(" ckpt", "\nckpt") for p in preds]
    fig, (a, b) = plt.subplots(1, 2, figsize=(14, 1 + 0.8 * len(preds)))
    biggest = max(p.memory["total"] for p in preds)
    name, unit = next((n, u) for n, u in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3), ("B", 1))
                      if biggest >= u or u == 1)
    _stacked(a, labels, [(k, lambda p, k=k: p.memory[k]) for k in KINDS], preds, unit)
    a.set_xlabel(f"{name} per device")
    if capacity is not None and capacity < 4 * biggest:
        a.axvline(capacity / unit, color="black", linestyle="--", linewidth=1)
        a.text(capacity / unit, -0.6, " device memory", fontsize=8, va="bottom")
    axes = ("tp", "cp", "ep", "pp", "dp")
    parts = [("compute", lambda p: p.compute), ("bubble", lambda p: p.bubble)]
    parts += [(f"{ax} comm", lambda p, ax=ax: p.comm.get(ax, 0.0)) for ax in axes]
    parts.append(("update, other", lambda p: max(0.0, p.step - p.compute - p.bubble
                                                  - sum(p.comm.get(ax, 0.0) for ax in axes))))
    _stacked(b, labels, parts, preds, 1.0)
    b.set_xlabel("seconds per step")
    b.set_yticks([])
    fig.tight_layout()
    fig.savefig(path)
