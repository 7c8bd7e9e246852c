"""Reading spans: the bubble fraction of a run, and its timeline as ASCII rows or a picture.

The functions take the span dicts of `minidist.trace.tracer` -- measured by a `Tracer`, or produced
by the pipeline simulator in model time units -- so measured and simulated runs are drawn the same
way. `minidist.trace` re-exports all of them.
"""

from __future__ import annotations

import statistics


def _t_origin(events: list[dict]) -> float:
    return min((e["t0"] for e in events), default=0.0)


def bubble_fraction(events: list[dict]) -> float:
    """Idle share of the ranks x [first start, last end] rectangle: 1 - compute time / (ranks x span).

    Only "compute" events count as work; sends, receives and waits are idle time. Every rank that
    appears in `events` counts, so give it the events of one training step (or of a whole run).
    """
    if not events:
        raise ValueError("bubble_fraction needs at least one event")
    ranks = {e["rank"] for e in events}
    span = max(e["t1"] for e in events) - _t_origin(events)
    busy = sum(e["t1"] - e["t0"] for e in events if e["cat"] == "compute")
    return 1.0 - busy / (len(ranks) * span) if span > 0 else 0.0


def median_bubble(steps_per_rank: list[list[list[dict]]], skip: int = 1,
                  names: tuple | None = ("Forward", "Backward")) -> float:
    """Median over training steps of the measured bubble (``bubble_fraction``) of all ranks together.

    ``steps_per_rank[r][s]``: rank r's events of step s (what each rank recorded between two
    step marks, gathered on one rank). The first ``skip`` steps are warm-up and left out -- as many
    as leave one step. ``names``: the events that count as the pipeline's work (None: every event);
    forward and backward by default, so an optimizer step or a data-parallel all-reduce is idle.
    The median, because one step slowed by a busy machine must not move the number.
    """
    if not steps_per_rank or any(len(s) != len(steps_per_rank[0]) for s in steps_per_rank):
        counts = [len(s) for s in steps_per_rank]
        raise ValueError(f"median_bubble needs the same number (>= 1) of steps from every rank, got {counts}")
    n = len(steps_per_rank[0])
    if n == 0 or skip < 0:
        raise ValueError(f"median_bubble needs >= 1 step and skip >= 0, got {n} steps, skip={skip}")

    def step_bubble(s):
        return bubble_fraction([e for steps in steps_per_rank for e in steps[s]
                                if names is None or e["name"] in names])
    return statistics.median(step_bubble(s) for s in range(min(skip, n - 1), n))


def _cells(event: dict, width: int) -> str:
    """Characters for one compute op `width` columns wide: 'F3fff' = forward of microbatch 3."""
    letter = (event["name"][:1] or "?").upper()
    mb = event.get("args", {}).get("mb")
    label = letter if mb is None else f"{letter}{mb}"
    if width >= len(label):
        return label + letter.lower() * (width - len(label))
    return letter * width


def ascii_timeline_from_events(events: list[dict], width: int = 100, label: str = "rank") -> str:
    """One row per rank, time left to right over `width` columns.

    A compute op is drawn as its first letter and microbatch ('F3fff', 'B3bbbbbb'; just 'FFF' when
    there is no room for the digits); everything else (send, recv, wait, idle) is '.'.
    """
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    if not events:
        return ""
    t_origin = _t_origin(events)
    span = max(e["t1"] for e in events) - t_origin
    scale = width / span if span > 0 else 0.0
    ranks = sorted({e["rank"] for e in events})
    name_w = len(f"{label} {ranks[-1]}")
    rows = []
    for r in ranks:
        row = ["."] * width
        for e in events:
            if e["rank"] != r or e["cat"] != "compute" or e["t1"] <= e["t0"]:
                continue
            c0 = min(width - 1, round((e["t0"] - t_origin) * scale))
            c1 = min(width, round((e["t1"] - t_origin) * scale))
            if c1 <= c0:  # too short to see at this width: one column if it is free
                if row[c0] == ".":
                    row[c0] = e["name"][:1].upper()
                continue
            row[c0:c1] = _cells(e, c1 - c0)
        rows.append(f"{label} {r}".ljust(name_w) + " |" + "".join(row) + "|")
    return "\n".join(rows)


_COLORS = {"compute": "#4c72b0", "compute (backward)": "#1f3b63", "compute (weight gradients)": "#937860",
           "send": "#dd8452", "recv": "#55a868", "wait": "#c44e52", "collective": "#8172b3",
           "step": "#cccccc"}


def _kind(e: dict) -> str:
    """A span's colour key: its category; a backward's B (or whole backward) and a split one's W apart."""
    if e["cat"] != "compute" or not e["name"].startswith("B"):
        return e["cat"]
    return "compute (weight gradients)" if e["name"] == "BackwardWeight" else "compute (backward)"


def plot_timeline(path, events: list[dict], losses=None, title: str = "timeline", labels=None,
                  ms: bool = False) -> None:
    """Draw per-rank bars colored by category (backward ops darker, a split backward's weight
    gradients, W, brown; communication in a thinner band below the compute; a compute op's
    microbatch written inside its bar) and, if given, the loss curve. ``labels``: rank -> row label
    (e.g. "dp 0 · stage 1 · tp 0"; default "rank r");
    ``ms=True``: event times are seconds, drawn in milliseconds.

    Uses matplotlib's Agg canvas directly (no pyplot global state), so it is safe in any thread.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    t_origin = _t_origin(events)
    ranks = sorted({e["rank"] for e in events})
    fig = Figure(figsize=(10, 1.2 + 0.45 * max(1, len(ranks)) + (2.5 if losses is not None else 0)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(2 if losses is not None else 1, 1, squeeze=False,
                        gridspec_kw={"height_ratios": [2, 1]} if losses is not None else None)
    ax = axes[0][0]
    for e in events:
        if e["cat"] == "step":
            continue  # a step span covers everything; it would hide the ops it contains
        color = _COLORS[_kind(e)]
        # compute on the upper part of a rank's row, communication on the lower part: an all-reduce
        # that overlaps backward shows under it instead of hiding it
        band = (e["rank"] - 0.4, 0.5) if e["cat"] == "compute" else (e["rank"] + 0.12, 0.28)
        k = 1e3 if ms else 1.0
        x0, w = (e["t0"] - t_origin) * k, max(e["t1"] - e["t0"], 0.0) * k
        ax.broken_barh([(x0, w)], band, facecolors=color, edgecolors="white", linewidth=0.5)
        mb = e.get("args", {}).get("mb") if e["cat"] == "compute" else None
        if mb is not None:
            ax.text(x0 + w / 2, band[0] + band[1] / 2, str(mb), ha="center", va="center", fontsize=6,
                    color="white", clip_on=True)
    ax.set_yticks(ranks)
    ax.set_yticklabels([(labels or {}).get(r, f"rank {r}") for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("time since the first event (ms)" if ms else "time since the first event (s)")
    ax.set_title(title, loc="right", pad=16)  # above the legend
    kinds = {_kind(e) for e in events if e["cat"] != "step"}
    order = ["compute", "compute (backward)", "compute (weight gradients)", "send", "recv", "wait",
             "collective"]
    handles = [Patch(color=_COLORS[k], label=k) for k in order if k in kinds]  # only what is drawn
    ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0, 1.0), fontsize=7,
              ncol=max(len(handles), 1), frameon=False)
    if losses is not None:
        lax = axes[1][0]
        lax.plot(range(len(losses)), list(losses), marker=".")
        lax.set_xlabel("training step")
        lax.set_ylabel("loss, nats/token")
    fig.tight_layout()
    fig.savefig(path)
