"""Chapter 0's picture: the roofline of every hardware preset (and this machine, once calibrated).

Attainable FLOP/s at arithmetic intensity I (FLOPs per byte moved to and from memory) is
min(peak FLOP/s, I x memory bytes/s): a slope where an op is memory-bound, a flat roof where it is
compute-bound, meeting at the ridge point (a dot). The crosses are the ops the caller marks on the
H100's roofline: chapter 0 (`python -m minidist.plan.estimates --plot`) marks a 4096^3 bf16 matmul
and a decode step at batch 1 and 256.
"""

from __future__ import annotations

import numpy as np


def plot_roofline(path, presets: dict, examples: list, mine=None) -> None:
    """Draw the rooflines of `presets` (name -> Hardware) and of `mine` (a calibrated Hardware or
    None) into `path`, FLOP/s in TFLOP/s on log-log axes, the ridge (peak / bandwidth) of each
    marked; `examples`: (label, FLOPs per byte) of ops to mark on the H100's roofline."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.6))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    intensity = np.logspace(-1, 4, 200)
    machines = list(presets.values()) + ([mine] if mine is not None else [])
    for hw in machines:
        attainable = np.minimum(hw.peak_flops, intensity * hw.hbm_bandwidth) / 1e12
        ridge = hw.peak_flops / hw.hbm_bandwidth
        style = {"ls": "--", "color": "black"} if hw is mine else {}
        line, = ax.plot(intensity, attainable, lw=1.6, **style,
                        label=f"{hw.name}{', calibrated matmul' if hw is mine else ''}: ridge {ridge:.0f}")
        ax.plot([ridge], [hw.peak_flops / 1e12], "o", ms=4, color=line.get_color())
    h100 = presets["h100"]
    offsets = [(-30, 10), (6, -12), (-40, -16)]
    for (label, i), offset in zip(examples, offsets + [(6, -12)] * len(examples)):
        y = min(h100.peak_flops, i * h100.hbm_bandwidth) / 1e12
        ax.plot([i], [y], "kx", ms=7)
        ax.annotate(f"{label} (H100)", (i, y), textcoords="offset points", xytext=offset, fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOPs per byte of memory traffic)")
    ax.set_ylabel("attainable TFLOP/s (bf16 dense)")
    ax.set_title("Roofline: min(peak FLOP/s, intensity x memory bandwidth); dot = ridge point")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, which="major", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
