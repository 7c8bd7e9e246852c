"""Re-cut a pipeline while it trains: when a new cut pays, and ``move_layers`` to make it.

* ``step_time``: a 1F1B step with stage costs c_s (per step, free communication) lasts
  T = Σ_s c_s/m + (m-1)·max_s c_s/m: one microbatch crosses every stage, the other m - 1 follow at
  the slowest stage's pace. ``bubble`` is its idle share, ``stage_costs`` a cut's c_s.
* ``pays_off``: moving costs ``move_seconds`` once and saves ``T_now - T_new`` per step, so it pays
  for itself when that saving times the steps left exceeds the move.
* ``move_layers`` -- at a step boundary (no gradients in flight), each layer whose stage changes is
  sent by its old stage to its new one, point-to-point: parameters and optimizer state (momentum,
  Adam's m and v), in one flat message per (old, new) pair. Every rank processes the pairs in the
  same order, so blocking sends cannot deadlock. Every rank built the whole model from the same
  seed; a layer it receives overwrites its stale copy, so training with moves equals the serial twin.
"""

from __future__ import annotations

import numpy as np

from minidist.accel.backend import to_host
from minidist.nn.optim import make_optimizer
from minidist.parallel.balance.profile import ProfiledStage

MOVE_TAG = 7


def move_layers(comm, model, old_bounds, new_bounds, opt, stage_args: dict, optimizer: str, lr: float):
    """Move every layer whose stage changes, with its optimizer state; returns (stage, optimizer, bytes).

    ``opt`` is this stage's optimizer over ``PipelineStage.parameters()``; the returned optimizer is
    a fresh one over the new stage's parameters with the old state (and step count) carried over."""
    me = comm.rank
    layers = list(model)
    old_state = {name: st for (name, _), st in zip(_named(old_bounds, me, layers), opt.state)}
    moving = [(i, stage_of(old_bounds, i), stage_of(new_bounds, i)) for i in range(len(layers))]
    pairs = sorted({(s, d) for _, s, d in moving if s != d})
    sent = 0
    for src, dst in pairs:
        ids = [i for i, s, d in moving if (s, d) == (src, dst)]
        names = [(f"{i}.{n}", p) for i in ids for n, p in layers[i].named_parameters()]
        if me == src:
            keys = [sorted(old_state.get(n, {})) for n, _ in names]
            arrays = [p.backend.to_host(p.data) for _, p in names] + \
                     [p.backend.to_host(old_state[n][k]) for (n, p), ks in zip(names, keys) for k in ks]
            flat = np.concatenate([np.asarray(a).reshape(-1) for a in arrays])
            comm.send_obj(keys, dst, MOVE_TAG)
            comm.send(flat, dst, MOVE_TAG)
            sent += flat.nbytes
        elif me == dst:
            keys = comm.recv_obj(src, MOVE_TAG)
            flat = to_host(comm.recv(src, MOVE_TAG))
            pieces = iter(np.split(flat, np.cumsum([p.size for _, p in names] +
                                                   [p.size for (_, p), ks in zip(names, keys) for _ in ks])))
            for _, p in names:
                p.data = _device(p, next(pieces))
            for (n, p), ks in zip(names, keys):
                old_state[n] = {k: _device(p, next(pieces)) for k in ks}
    stage = ProfiledStage(model, new_bounds, me, len(new_bounds), **stage_args)
    new_opt = make_optimizer(optimizer, stage.parameters(), lr)
    new_opt.step_count = opt.step_count
    new_opt.state = [dict(old_state.get(n, {})) for n, _ in stage.named_parameters()]
    return stage, new_opt, sent


def _device(p, flat):
    """A received flat piece as an array shaped, typed and placed like parameter ``p``."""
    return p.backend.from_host(np.ascontiguousarray(flat.reshape(p.shape).astype(p.dtype)))


def _named(bounds, stage: int, layers):
    a, b = bounds[stage]
    return [(f"{i}.{n}", p) for i in range(a, b) for n, p in layers[i].named_parameters()]


def stage_of(bounds, layer: int) -> int:
    return next(s for s, (a, b) in enumerate(bounds) if a <= layer < b)


def stage_costs(bounds, costs) -> list[float]:
    return [float(np.sum(costs[a:b])) for a, b in bounds]


def step_time(costs_per_stage, microbatches: int) -> float:
    """A 1F1B step with stage s costing c_s per step (its m microbatches' forward+backward) and free
    communication: one microbatch crosses every stage (Σ_s c_s / m), and the other m - 1 follow at
    the pace of the slowest stage: T = Σ_s c_s / m + (m - 1) · max_s c_s / m.
    (Equal stages c: T = (m + p - 1) · c / m, the textbook bubble (p-1)/(m+p-1).)"""
    c = np.asarray(costs_per_stage, np.float64)
    m = microbatches
    return float(c.sum() / m + (m - 1) * c.max() / m)


def bubble(costs_per_stage, microbatches: int) -> float:
    """Idle share of p stages x the step: 1 - Σ_s c_s / (p · T)."""
    c = np.asarray(costs_per_stage, np.float64)
    return float(1 - c.sum() / (len(c) * step_time(c, microbatches)))


def pays_off(t_now: float, t_new: float, steps_left: int, move_seconds: float) -> bool:
    """Moving pays for itself when the time it saves over the remaining steps exceeds its one-off
    cost: (T_now - T_new) · steps_left > move_seconds (T from ``step_time``)."""
    return (t_now - t_new) * steps_left > move_seconds


def _slots(optimizer: str) -> int:
    """Arrays of optimizer state per parameter (SGD here has no momentum: 0; AdamW: m and v)."""
    return 2 if optimizer == "adamw" else 0


def layer_memory_bytes(layer, optimizer: str, act_bytes: float, in_flight: int) -> float:
    """What a layer costs the stage that holds it (the memory cap's unit, and what a move sends): its
    parameters and their optimizer state, plus the activations of the ``in_flight`` microbatches 1F1B
    keeps on the first stage (min(m, p)); ``act_bytes`` per microbatch."""
    return sum(q.data.nbytes for q in layer.parameters()) * (1 + _slots(optimizer)) + act_bytes * in_flight
