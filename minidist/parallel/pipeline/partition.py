"""Cutting a model into pipeline stages: which contiguous layers each stage holds.

* ``partition_uniform`` -- by layer count (near-equal lengths).
* ``partition_balanced`` -- contiguous groups minimising the most expensive stage, by dynamic programming
  over per-layer costs (optionally within a memory cap per stage): the pipeline runs at the pace of its
  slowest stage.
* ``partition_for`` -- the cut for a schedule's placement. With several pieces a rank, what must be
  balanced is each *rank's* pieces together: a V (``partition_v``, exact) is cut from both ends at
  once; looped chunks keep the min-max over pieces (each rank at most ``chunks`` x the largest).
* ``rank_loads`` -- what a cut gives each rank of a placement.
* ``layer_costs`` -- those costs: measured forward+backward seconds, or parameter bytes.
* ``format_partition`` -- the cut and each stage's predicted cost, one line per stage.
"""

from __future__ import annotations

import numpy as np

from minidist.autograd.tensor import Tensor
from minidist.comm import split_sizes
from minidist.trace import clock


def _check_parts(num_layers: int, num_parts: int) -> None:
    if not isinstance(num_parts, int) or num_parts < 1:
        raise ValueError(f"number of stages must be an int >= 1, got {num_parts!r}")
    if num_parts > num_layers:
        raise ValueError(f"cannot cut {num_layers} layers into {num_parts} pipeline stages: every stage "
                         f"needs at least one layer; use at most {num_layers} stages (or a deeper model)")


def partition_uniform(num_layers: int, num_parts: int) -> list[tuple[int, int]]:
    """Contiguous (start, end) layer ranges of near-equal length (the first ones one longer)."""
    _check_parts(num_layers, num_parts)
    ends = np.cumsum(split_sizes(num_layers, num_parts)).tolist()
    return list(zip([0] + ends[:-1], ends))


def partition_balanced(costs, num_parts: int, memory=None, cap: float | None = None) -> list[tuple[int, int]]:
    """Contiguous ranges minimising the largest per-stage cost sum (dynamic programming, O(n^2 p)).

    The pipeline runs at the pace of its slowest stage, so that is the number to minimise.
    With ``memory`` (one number per layer) and ``cap``, no stage may hold more than ``cap`` of it.
    """
    costs = [float(c) for c in costs]
    n = len(costs)
    _check_parts(n, num_parts)
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    mem = np.concatenate([[0.0], np.cumsum(memory)]) if memory is not None and cap is not None else None
    inf = float("inf")
    # best[k][i]: smallest max-stage cost putting the first i layers in k stages; cut[k][i]: last start
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0.0
    for k in range(1, num_parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                if mem is not None and mem[i] - mem[j] > cap:
                    continue  # layers j..i-1 would not fit one stage's memory
                c = max(best[k - 1][j], prefix[i] - prefix[j])
                if c < best[k][i]:
                    best[k][i], cut[k][i] = c, j
    if best[num_parts][n] == inf:
        raise ValueError(f"no cut of {n} layers into {num_parts} stages keeps every stage within the memory "
                         f"cap {cap:g} (largest layer: {max(memory):g}); raise the cap or add stages")
    bounds, end = [], n
    for k in range(num_parts, 0, -1):
        start = cut[k][end]
        bounds.append((start, end))
        end = start
    return bounds[::-1]


def partition_for(costs, placement, memory=None, cap: float | None = None) -> list[tuple[int, int]]:
    """The balanced cut into ``placement.num_virtual`` pieces, judged by the busiest rank.

    One piece a rank: ``partition_balanced``. A V: ``partition_v`` (exact); DualPipe's two copies
    too (rank s holds pieces s and p-1-s of p: a V of p/2 ranks). Looped chunks (interleaved):
    ``partition_balanced`` over the pieces, which bounds each rank by ``chunks`` times the largest
    piece (rank s's pieces s, s+p, ... are spread over the model: no cut of both ends applies)."""
    if placement.shape in ("v", "dual"):
        return partition_v(costs, placement.num_virtual // 2, memory, cap)
    return partition_balanced(costs, placement.num_virtual, memory, cap)


def rank_loads(bounds, costs, placement) -> list[float]:
    """Each rank's summed cost (or memory) over the pieces ``placement`` gives it."""
    return [sum(float(sum(costs[slice(*bounds[placement.virtual_stage(s, c)])]))
                for c in range(placement.chunks)) for s in range(placement.num_stages)]


def partition_v(costs, num_stages: int, memory=None, cap: float | None = None) -> list[tuple[int, int]]:
    """The cut of a V placement (rank s holds piece s and piece 2p-1-s) minimising the busiest rank.

    Rank s's two pieces are the s-th from the front and the s-th from the back of the model, so the
    cut is made from both ends at once: after s ranks the front ``[0, i)`` and the back ``[j, n)`` are
    taken, and ``best[(i, j)]`` is the smallest load of the busiest of those ranks (dynamic
    programming, O(p n^4)). The last rank takes the middle ``[i, j)`` (its two pieces meet at the V's
    turn). Among the cuts as good for the ranks, the one whose largest piece is smallest: a piece is
    one hop of the V, and a long one holds up the ranks after it. A uniform cut of a GPT gives rank 0
    the embedding, the head and two blocks' worth of pieces, and rank p-1 the middle of the model,
    blocks only.
    With ``memory`` and ``cap``: no rank's two pieces together above ``cap``."""
    costs = [float(c) for c in costs]
    n = len(costs)
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"number of stages must be an int >= 1, got {num_stages!r}")
    if n < 2 * num_stages:
        fix = f"use at most {n // 2} ranks (or a deeper model)" if n >= 2 else "a V needs 2 layers or more"
        raise ValueError(f"a V over {num_stages} ranks holds {2 * num_stages} pieces of at least one layer: "
                         f"{n} layers are too few; {fix}")
    pre = np.concatenate([[0.0], np.cumsum(costs)]).tolist()
    capped = memory is not None and cap is not None
    mem = np.concatenate([[0.0], np.cumsum(memory)]).tolist() if capped else None

    def load(a, b, c, d):  # a rank holding [a, b) and [c, d)
        return pre[b] - pre[a] + pre[d] - pre[c]

    def fits(a, b, c, d):
        return mem is None or (mem[b] - mem[a]) + (mem[d] - mem[c]) <= cap
    worst, _ = _cut_v(n, num_stages, load, fits)
    if worst is None:
        raise ValueError(f"no V cut of {n} layers over {num_stages} ranks keeps every rank within the "
                         f"memory cap {cap:g}; raise the cap or add stages")
    limit = worst * (1 + 1e-12) + 1e-300
    _, bounds = _cut_v(n, num_stages, lambda a, b, c, d: max(pre[b] - pre[a], pre[d] - pre[c]),
                       lambda a, b, c, d: fits(a, b, c, d) and load(a, b, c, d) <= limit)
    return bounds


def _cut_v(n: int, p: int, score, allowed):
    """``partition_v``'s dynamic programme: the V cut minimising the largest ``score`` of a rank's two
    pieces, among those ``allowed``; (that score, the bounds), or (None, None) if none is allowed."""
    best, back = {(0, n): 0.0}, [{}]
    for s in range(p - 1):  # rank s takes [i, i2) from the front and [j2, j) from the back
        nxt, came = {}, {}
        left = 2 * (p - 1 - s)  # layers the ranks after s still need, two each
        for (i, j), worst in best.items():
            for i2 in range(i + 1, j):
                for j2 in range(i2 + left, j):
                    if allowed(i, i2, j2, j):
                        c = max(worst, score(i, i2, j2, j))
                        if c < nxt.get((i2, j2), float("inf")):
                            nxt[(i2, j2)], came[(i2, j2)] = c, (i, j)
        best = nxt
        back.append(came)
    ends = [(max(w, score(i, k, k, j)), (i, k, j)) for (i, j), w in best.items()
            for k in range(i + 1, j) if allowed(i, k, k, j)]  # the last rank: [i, k) and [k, j)
    if not ends:
        return None, None
    worst, (i, k, j) = min(ends)
    front, rear = [(i, k)], [(k, j)]  # pieces p-1 and p
    for s in range(p - 1, 0, -1):
        i0, j0 = back[s][(i, j)]
        front.append((i0, i))
        rear.append((j, j0))
        i, j = i0, j0
    return worst, front[::-1] + rear


def layer_costs(model, sample_input, by: str = "time", repeats: int = 3) -> list[float]:
    """Per-layer cost of a Sequential: "time" = median forward+backward seconds on `sample_input`
    as this rank's clock counts them (``trace.clock.now``: the virtual clock's CPU time or device
    model when it runs, else wall time), "params" = parameter bytes."""
    layers = list(model)
    if by == "params":
        return [float(sum(p.data.nbytes for p in layer.parameters())) for layer in layers]
    if by != "time":
        raise ValueError(f"layer_costs(by={by!r}): use 'time' or 'params'")
    times = np.zeros((repeats, len(layers)))
    for r in range(repeats):
        x = sample_input
        for i, layer in enumerate(layers):
            inp = Tensor(x.data, requires_grad=True) if isinstance(x, Tensor) else x
            t0 = clock.now()
            out = layer(inp)
            out.backward(out.backend.xp.ones(out.shape, dtype=out.dtype))
            times[r, i] = clock.now() - t0
            x = out.detach()
    return [float(t) for t in np.median(times, axis=0)]


def format_partition(bounds, costs=None, unit: str = "", placement=None) -> str:
    """One line per stage: its layers and (if costs are given) predicted cost and share of the total.
    With a `placement` of several chunks per rank, one line per piece (virtual stage) and its rank."""
    total = sum(costs) if costs is not None else None
    lines = []
    for s, (a, b) in enumerate(bounds):
        where = f"stage {s}" if placement is None or placement.chunks == 1 else \
            f"piece {s} (ranks {s} and {len(bounds) - 1 - s}, one per copy)" if placement.copies == 2 else \
            f"piece {s} (rank {placement.owner(s)[0]} chunk {placement.owner(s)[1]})"
        line = f"{where}: layers {a}..{b - 1} ({b - a} layer{'s' if b - a != 1 else ''})"
        if costs is not None:
            c = sum(costs[a:b])
            line += f"  predicted cost {c:.4g}{unit} ({100 * c / total:.0f}%)" if total else ""
        lines.append(line)
    return "\n".join(lines)
