"""The collectives one rank runs in one training step, per mesh axis, with the bytes it sends.

`collectives(model, cand, batch, stage, dp_rank=0, tp_rank=0)` lists `Collective(axis, name,
payload, sent, count, phase)`: the rank at those mesh coordinates calls `name` `count` times on `axis`
("tp", "dp", "pp", "cp", "ep") with a `payload`-byte buffer and sends `sent` bytes each time.

For the "minidist" engine these are exactly the calls minidist makes (tests compare with the
ledger, `minidist.comm.ledger`): per microbatch the tensor-parallel group all-reduces the embedding
lookup, two b·s·h activations per block forward and two gradients per block backward, the LM head's
input gradient, and three b·s numbers for the vocabulary-parallel loss (max, target logit, sum of
exponentials); data parallelism all-reduces DDP's gradient buckets once per step (ZeRO 1-2:
reduce-scatter + all-gather per bucket); the pipeline sends one b·s·h activation forward and one
gradient back per microbatch and stage boundary. All-reduces are minidist's ring over
`np.array_split` chunks: rank r sends 2N - |chunk r| - |chunk r+1| bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from minidist.comm.collectives import split_sizes
from minidist.plan.mesh import (
    DEFAULT,
    Candidate,
    Settings,
    layer_kinds,
    minidist_buckets,
    stage_layers,
    stage_param_counts,
)
from minidist.plan.model import ModelSpec


@dataclass(frozen=True)
class Collective:
    axis: str
    name: str
    payload: float     # bytes of the buffer each rank contributes / receives
    sent: float        # bytes this rank sends per call
    count: int         # calls per step
    phase: str         # "forward", "backward", "step"


def ring_sent(nbytes: float, p: int, itemsize: int = 1, rank: int = 0) -> float:
    """Bytes rank `rank` sends in minidist's ring all-reduce of `nbytes` (chunks: np.array_split)."""
    if p == 1:
        return 0.0
    n = int(nbytes) // itemsize
    c = split_sizes(n, p)
    return float(itemsize * (2 * n - c[rank] - c[(rank + 1) % p]))


def gather_sent(nbytes: float, p: int, itemsize: int = 1, rank: int = 0) -> float:
    """Bytes sent by rank `rank` in a ring all-gather (or reduce-scatter) of an `nbytes` result:
    every part but one (reduce-scatter: all but my own; all-gather: all but part r+1)."""
    if p == 1:
        return 0.0
    n = int(nbytes) // itemsize
    c = split_sizes(n, p)
    return float(itemsize * (n - c[(rank + 1) % p]))


def _tp_calls(model: ModelSpec, cand: Candidate, stage: int, m: int, r: int) -> list[Collective]:
    tp, b, s, h = cand.tp, cand.microbatch, model.seq // cand.cp, model.d_model
    d = model.dtype_bytes
    act = b * s * h * d
    kinds = [layer_kinds(model)[i] for i in stage_layers(model, cand)[stage]]
    blocks, first, last = kinds.count("block"), "embed" in kinds, "head" in kinds
    fwd = 2 * blocks + int(first)
    bwd = 2 * blocks + int(last)
    recompute = 2 * blocks if cand.checkpoint == "full" else 0
    per = m  # the stage's layers (all its chunks) run once per microbatch
    calls = [Collective("tp", "ring_all_reduce", act, ring_sent(act, tp, d, r), per * fwd, "forward"),
             Collective("tp", "ring_all_reduce", act, ring_sent(act, tp, d, r), per * (bwd + recompute),
                        "backward")]
    if last and model.engine == "minidist":
        small = b * s * d
        sent = ring_sent(small, tp, d, r)
        calls.append(Collective("tp", "ring_all_reduce", small, sent, 3 * per, "forward"))
    return [c for c in calls if c.count]


def _dp_calls(model: ModelSpec, cand: Candidate, stage: int, settings: Settings, batch: int,
              r: int) -> list[Collective]:
    _, gb, _ = settings.bytes_for(model)
    _, sizes = stage_param_counts(model, cand, stage)
    p = cand.dp
    if model.engine == "minidist":
        buckets = minidist_buckets(model, cand, stage, gb)
    else:
        buckets = [(sum(sizes), "mixed")]
    calls = []
    for n, kind in buckets:
        nb = n * gb
        if cand.zero == 0:
            calls.append(Collective("dp", "ring_all_reduce", nb, ring_sent(nb, p, gb, r), 1, "step"))
        else:
            sent = gb * (n - split_sizes(n, p)[r])  # all but my own part
            calls.append(Collective("dp", "reduce_scatter", nb, sent, 1, "step"))
            pb = settings.bytes_for(model)[0]
            # ZeRO-3: gathered before forward and again for backward (not the embedding: a lookup's
            # gradient needs no weights), for every microbatch: accumulating would keep them whole
            gathers = 1 if cand.zero < 3 else cand.microbatches(batch) * (1 if kind == "embed" else 2)
            calls.append(Collective("dp", "all_gather", n * pb, gather_sent(n * pb, p, pb, r), gathers,
                                    "forward" if cand.zero >= 3 else "step"))
    return [c for c in calls if c.sent or p > 1]


def _pp_calls(model: ModelSpec, cand: Candidate, stage: int, m: int) -> list[Collective]:
    if cand.pp == 1:
        return []
    act = cand.microbatch * model.seq // cand.cp * model.d_model * model.dtype_bytes
    if model.engine == "megatron":  # scatter/gather: each tp rank sends 1/tp (Narayanan 2021, 4.1)
        act /= cand.tp
    calls = []
    sends_act = sum(1 for c in range(cand.chunks) if c * cand.pp + stage < cand.pp * cand.chunks - 1)
    sends_grad = sum(1 for c in range(cand.chunks) if c * cand.pp + stage > 0)
    if sends_act:
        calls.append(Collective("pp", "send_activation", act, act, m * sends_act, "forward"))
    if sends_grad:
        calls.append(Collective("pp", "send_gradient", act, act, m * sends_grad, "backward"))
    return calls


def _cp_ep_calls(model: ModelSpec, cand: Candidate, stage: int, m: int) -> list[Collective]:
    """Context parallel: each layer all-gathers k and v over cp in forward (and reduce-scatters their
    gradients in backward). Expert parallel: each MoE layer's tokens go to their experts and back by
    all-to-all, in forward and backward (Lepikhin et al. 2020, GShard)."""
    calls = []
    b, s, d = cand.microbatch, model.seq // cand.cp, model.dtype_bytes
    kinds = [layer_kinds(model)[i] for i in stage_layers(model, cand)[stage]]
    blocks = kinds.count("block")
    if cand.cp > 1:
        kv = 2 * b * s * model.kv * model.head_dim * d * cand.cp
        sent = kv * (cand.cp - 1) / cand.cp
        calls += [Collective("cp", "all_gather", kv, sent, m * blocks, "forward"),
                  Collective("cp", "reduce_scatter", kv, sent, m * blocks, "backward")]
    if cand.ep > 1 and model.experts > 1:
        moe = round(blocks * model.moe_layers / model.n_layer)
        tokens = b * s * model.d_model * d * model.top_k
        sent = tokens * (cand.ep - 1) / cand.ep
        calls += [Collective("ep", "all_to_all", tokens, sent, 2 * m * moe, "forward"),
                  Collective("ep", "all_to_all", tokens, sent, 2 * m * moe, "backward")]
    return calls


def collectives(model: ModelSpec, cand: Candidate, batch: int, stage: int = 0,
                settings: Settings = DEFAULT, dp_rank: int = 0, tp_rank: int = 0) -> list[Collective]:
    """Every collective the rank at (stage, dp_rank, tp_rank) runs in one step (module docstring)."""
    m = cand.microbatches(batch)
    out = _tp_calls(model, cand, stage, m, tp_rank) if cand.tp > 1 else []
    out += _dp_calls(model, cand, stage, settings, batch, dp_rank) if cand.dp > 1 else []
    out += _pp_calls(model, cand, stage, m)
    out += _cp_ep_calls(model, cand, stage, m)
    return out


def bytes_by_axis(calls: list[Collective]) -> dict:
    out: dict = {}
    for c in calls:
        out[c.axis] = out.get(c.axis, 0.0) + c.sent * c.count
    return out
