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
gradient back per microbatch and stage boundary. Each all-reduce runs the algorithm its caller
asks the comm layer for (`DP_ALGORITHM`: DDP's, `TP_ALGORITHM`: the tensor-parallel layers'), and
for "auto" the one the comm layer's own `choose_algorithm` picks for that size, group and
transport (`all_reduce_algorithm`), so the planner follows the comm layer rather than assuming one.
minidist's ring runs over `np.array_split` chunks: rank r sends 2N - |chunk r| - |chunk r+1| bytes.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from minidist.comm import cost, split_sizes
from minidist.comm.transports import shm
from minidist.parallel.data.ddp import DistributedDataParallel
from minidist.parallel.tensor import comm as tp_comm
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

# the all-reduce algorithm each caller asks for, read from the callers themselves
DP_ALGORITHM = inspect.signature(DistributedDataParallel.__init__).parameters["algorithm"].default
TP_ALGORITHM = tp_comm.ALGORITHM


@dataclass(frozen=True)
class Placement:
    """Where the ranks run, as far as the comm layer's `auto` choice cares: the transport ("threads"
    or "mpi"), whether this host's ranks outnumber its cores (`minidist.comm.cost.crowded`), and
    whether every rank shares one node's memory (`minidist.comm.transports.shm`: MPI, one node, no
    emulated link)."""
    transport: str = "threads"
    crowded: bool = False
    shared_memory: bool = False


THREADS = Placement()


def all_reduce_algorithm(requested: str, nbytes: float, p: int, where: Placement = THREADS) -> str:
    """The all-reduce algorithm minidist runs: `requested`, or for "auto" what `minidist.comm.all_reduce`
    picks: "shm" on the MPI transport with every rank on one node (where `cost.shm_wins`), else the
    cost model's `choose_algorithm` for this size, group and crowding (every rank of a group agrees)."""
    if requested != "auto":
        return requested
    return cost.auto_algorithm(int(nbytes), p, where.crowded, where.shared_memory, shm.window_bytes(p))


def shm_pieces(nbytes: float, p: int, itemsize: int) -> list[int]:
    """Elements of each piece a shared-memory all-reduce of `nbytes` over p ranks goes in
    (`shm.window_bytes(p)` each, what the window holds)."""
    n, step = int(nbytes) // itemsize, max(1, shm.window_bytes(p) // itemsize)
    return [min(step, n - lo) for lo in range(0, n, step)] or [0]


def all_reduce_rounds(algorithm: str, nbytes: float, p: int, itemsize: int = 4) -> int:
    """Rounds of one all-reduce, each a wait for the partners: per `minidist.comm.cost.all_reduce_counts`
    (2(p-1) for an algorithm it does not know); "shm": per piece, one posting, two if it goes two-shot."""
    if p == 1:
        return 0
    if algorithm == "shm":
        return sum(2 if cost.shm_two_shot(k * itemsize, p) else 1
                   for k in shm_pieces(nbytes, p, itemsize))
    try:
        return cost.all_reduce_counts(algorithm, int(nbytes), p)[0]
    except ValueError:
        return 2 * (p - 1)


def all_reduce_sent(algorithm: str, nbytes: float, p: int, itemsize: int = 4, rank: int = 0) -> float:
    """Bytes rank `rank` sends in one all-reduce, as the ledger counts them: the ring's uneven chunks
    (`ring_sent`); shm: every piece it writes into the window, plus its chunk of each piece that goes
    two-shot (`cost.shm_two_shot`); others by `cost.all_reduce_bytes_sent`."""
    if p == 1:
        return 0.0
    if algorithm == "ring":
        return ring_sent(nbytes, p, itemsize, rank)
    if algorithm == "shm":
        return float(itemsize * sum(k + (split_sizes(k, p)[rank] if cost.shm_two_shot(k * itemsize, p) else 0)
                                    for k in shm_pieces(nbytes, p, itemsize)))
    return float(cost.all_reduce_bytes_sent(algorithm, int(nbytes), p, rank))


@dataclass(frozen=True)
class Collective:
    axis: str
    name: str
    payload: float     # bytes of the buffer each rank contributes / receives
    sent: float        # bytes this rank sends per call
    count: int         # calls per step
    phase: str         # "forward", "backward", "step"


def all_reduce_call(axis: str, requested: str, nbytes: float, p: int, itemsize: int, rank: int, count: int,
                    phase: str, where: Placement = THREADS) -> Collective:
    """One all-reduce as the ledger records it: the algorithm's name and the bytes rank `rank` sends."""
    alg = all_reduce_algorithm(requested, nbytes, p, where)
    sent = all_reduce_sent(alg, nbytes, p, itemsize, rank)
    return Collective(axis, f"{alg}_all_reduce", nbytes, sent, count, phase)


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


def _tp_calls(model: ModelSpec, cand: Candidate, stage: int, m: int, r: int,
              where: Placement) -> list[Collective]:
    tp, b, s, h = cand.tp, cand.microbatch_size, model.seq // cand.cp, model.d_model
    d = model.dtype_bytes
    act = b * s * h * d
    kinds = [layer_kinds(model)[i] for i in stage_layers(model, cand)[stage]]
    blocks, first, last = kinds.count("block"), "embed" in kinds, "head" in kinds
    fwd = 2 * blocks + int(first)
    bwd = 2 * blocks + int(last)
    recompute = 2 * blocks if cand.checkpoint == "full" else 0
    per = m  # the stage's layers (all its chunks) run once per microbatch
    calls = [all_reduce_call("tp", TP_ALGORITHM, act, tp, d, r, per * fwd, "forward", where),
             all_reduce_call("tp", TP_ALGORITHM, act, tp, d, r, per * (bwd + recompute), "backward", where)]
    if last and model.engine == "minidist":
        calls.append(all_reduce_call("tp", TP_ALGORITHM, b * s * d, tp, d, r, 3 * per, "forward", where))
    return [c for c in calls if c.count]


def _dp_calls(model: ModelSpec, cand: Candidate, stage: int, settings: Settings, batch: int,
              r: int, where: Placement) -> list[Collective]:
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
            calls.append(all_reduce_call("dp", DP_ALGORITHM, nb, p, gb, r, 1, "step", where))
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
    act = cand.microbatch_size * model.seq // cand.cp * model.d_model * model.dtype_bytes
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


CP_MODES = ("allgather", "ring", "ulysses")


def cp_attention_calls(model: ModelSpec, cand: Candidate, count: int, mode: str = "allgather") -> list:
    """One rank's context-parallel attention traffic, ``count`` layer-microbatches, by ``mode``:
    "allgather" (Megatron: all-gather K, V forward, reduce-scatter their gradients backward); "ring"
    (minidist's ring, ``parallel/context/ring.py``: K, V hop cp-1 times forward; backward again, and
    dK, dV cp times); "ulysses" (``parallel/context/ulysses.py``: all-to-all of q|k|v and of the
    output forward, of the output gradient and dq|dk|dv backward, each sending (cp-1)/cp of it).
    Heads are this rank's (over tp)."""
    if mode not in CP_MODES:
        raise ValueError(f"cp_mode={mode!r}; use one of {CP_MODES}")
    p, b, s, d = cand.cp, cand.microbatch_size, model.seq // cand.cp, model.dtype_bytes
    kv_heads = max(model.kv // cand.tp, 1)  # this rank's K/V heads (replicated when tp exceeds them)
    if mode == "allgather":
        kv = 2 * b * s * kv_heads * model.head_dim * d * p
        sent = kv * (p - 1) / p
        return [Collective("cp", "all_gather", kv, sent, count, "forward"),
                Collective("cp", "reduce_scatter", kv, sent, count, "backward")]
    q = b * s * model.n_head // cand.tp * model.head_dim * d   # bytes of this rank's q (and output)
    kv = 2 * b * s * kv_heads * model.head_dim * d             # of its K and V
    if mode == "ring":
        return [Collective("cp", "ring_attention", kv, (p - 1) * kv, count, "forward"),
                Collective("cp", "ring_attention", kv, (2 * p - 1) * kv, count, "backward")]
    calls = []
    for phase, first, second in (("forward", q + kv, q), ("backward", q, q + kv)):
        calls += [Collective("cp", "all_to_all", x, x * (p - 1) / p, count, phase) for x in (first, second)]
    return calls


def _cp_ep_calls(model: ModelSpec, cand: Candidate, stage: int, m: int,
                 cp_mode: str = "allgather") -> list[Collective]:
    """Context parallel: each layer's attention traffic by ``cp_mode`` (:func:`cp_attention_calls`).
    Expert parallel: each MoE layer's tokens go to their experts and back by all-to-all, in forward
    and backward (Lepikhin et al. 2020, GShard)."""
    calls = []
    b, s, d = cand.microbatch_size, model.seq // cand.cp, model.dtype_bytes
    kinds = [layer_kinds(model)[i] for i in stage_layers(model, cand)[stage]]
    blocks = kinds.count("block")
    if cand.cp > 1:
        calls += cp_attention_calls(model, cand, m * blocks, cp_mode)
    if cand.ep > 1 and model.experts > 1:
        moe = round(blocks * model.moe_layers / model.n_layer)
        tokens = b * s * model.d_model * d * model.top_k
        sent = tokens * (cand.ep - 1) / cand.ep
        calls += [Collective("ep", "all_to_all", tokens, sent, 2 * m * moe, "forward"),
                  Collective("ep", "all_to_all", tokens, sent, 2 * m * moe, "backward")]
    return calls


def collectives(model: ModelSpec, cand: Candidate, batch: int, stage: int = 0,
                settings: Settings = DEFAULT, dp_rank: int = 0, tp_rank: int = 0,
                where: Placement = THREADS, cp_mode: str = "allgather") -> list[Collective]:
    """Every collective the rank at (stage, dp_rank, tp_rank) runs in one step (module docstring);
    `where`: the transport and crowding that the comm layer's "auto" all-reduce choice depends on;
    `cp_mode`: how context-parallel attention communicates (:func:`cp_attention_calls`)."""
    m = cand.microbatches(batch)
    out = _tp_calls(model, cand, stage, m, tp_rank, where) if cand.tp > 1 else []
    out += _dp_calls(model, cand, stage, settings, batch, dp_rank, where) if cand.dp > 1 else []
    out += _pp_calls(model, cand, stage, m)
    out += _cp_ep_calls(model, cand, stage, m, cp_mode)
    return out


def bytes_by_axis(calls: list[Collective]) -> dict:
    out: dict = {}
    for c in calls:
        out[c.axis] = out.get(c.axis, 0.0) + c.sent * c.count
    return out
