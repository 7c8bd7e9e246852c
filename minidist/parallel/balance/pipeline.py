"""Re-partition a pipeline while it trains: profile each layer, cut by min-max, move the layers.

    run = train_pipeline_balanced(comm, cfg, batches, microbatches=4, slow=Slowdown("layer=3,factor=4"))

* ``ProfiledStage`` -- a ``PipelineStage`` that times each of its layers while training: forward
  directly, backward with gradient hooks on each layer's output (the hook on y_i fires when layer
  i's backward can start; the one on y_{i-1} when it is done). A first layer fed by tokens has no
  input gradient to hook, so its backward is estimated as 2x its forward. ``Slowdown.layer_factor``
  stretches a layer's forward and backward: the emulated per-layer cost skew (and ``Slowdown.pace``
  makes every layer's forward last at least rows x pace: an emulated device, clean timings).
* Every step the stages agree on the whole model's per-layer cost and memory with one all-reduce of
  2·L numbers (each stage fills in its own layers). ``decide`` takes the median over a window and
  asks ``partition_balanced`` (the min-max contiguous cut, within a memory cap) for the best cut.
* ``step_time``: a 1F1B step lasts T = Σ_s c_s/m + (m-1)·max_s c_s/m (stage costs c_s per step).
  ``pays_off``: moving costs ``move_seconds`` once and saves ``T_now - T_new`` per step, so it pays
  for itself when that saving times the steps left exceeds the move.
* ``move_layers`` -- at a step boundary (no gradients in flight), each layer whose stage changes is
  sent by its old stage to its new one, point-to-point: parameters and optimizer state (momentum,
  Adam's m and v), in one flat message per (old, new) pair. Every rank processes the pairs in the
  same order, so blocking sends cannot deadlock. Dropout > 0 is refused: the pipeline's per-rank
  dropout streams would not match the serial twin's anyway, so there is no RNG state to move.

Every rank builds the whole GPT from the same seed; a rank uses only its stage's layers, and a
layer it receives overwrites its stale copy. So training with moves equals the serial twin.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from minidist.accel.backend import to_host
from minidist.autograd.tensor import Tensor
from minidist.comm import all_reduce
from minidist.nn import GPT
from minidist.nn.optim import make_optimizer
from minidist.parallel.data.weights import token_loss_weights
from minidist.parallel.pipeline.runtime import (
    PipelineStage,
    make_schedule,
    partition_balanced,
    partition_uniform,
    run_schedule,
    split_microbatches,
)
from minidist.resilience.stragglers import Slowdown, sleep_until

MOVE_TAG = 7


class ProfiledStage(PipelineStage):
    """A PipelineStage that measures each layer's forward+backward seconds and activation bytes."""

    def __init__(self, model, bounds, stage: int, num_stages: int, slow: Slowdown | None = None, **kw):
        super().__init__(model, bounds, stage, num_stages, **kw)
        self.slow = slow or Slowdown("")
        self.step = 0
        self.reset()

    def reset(self) -> None:
        """Start a new step's measurements."""
        ids = [i for c in self.layer_ids for i in c]
        self.fwd = dict.fromkeys(ids, 0.0)
        self.bwd = dict.fromkeys(ids, 0.0)
        self.act_bytes = dict.fromkeys(ids, 0)
        self._bwd_start: dict[int, float] = {}
        self._fwd_once: dict[int, float] = {}

    def forward(self, x, chunk: int = 0):
        ids = self.layer_ids[chunk]
        if isinstance(x, Tensor) and x.requires_grad:
            x.register_hook(self._backward_ends(ids[0]))
        timed_end = isinstance(x, Tensor) and x.requires_grad
        for k, (i, layer) in enumerate(zip(ids, self.chunks[chunk])):
            t0 = time.perf_counter()
            y = layer(x)
            real = time.perf_counter() - t0
            target = self.slow.target(real, x.shape[0], self.slow.layer_factor(i, self.step))
            sleep_until(t0, target)
            self.fwd[i] += target
            self._fwd_once[i] = (real, target)
            self.act_bytes[i] = max(self.act_bytes[i], int(y.data.nbytes))
            if y.requires_grad:
                y.register_hook(self._backward_starts(i, ids[k + 1] if k + 1 < len(ids) else None))
                if k == 0 and not timed_end:  # layer i's backward end is not observable: estimate it
                    self.bwd[i] += 2 * target
            x = y
        return x

    def _backward_starts(self, i: int, after: int | None):
        """Hook on y_i: layer ``after``'s backward (if any) ended, layer i's begins (slowed if skewed)."""
        def hook(grad):
            now = time.perf_counter()
            if after is not None and after in self._bwd_start:
                self.bwd[after] += now - self._bwd_start.pop(after)
            self._bwd_start[i] = now
            real, target = self._fwd_once.get(i, (0.0, 0.0))
            time.sleep(2 * (target - real))  # backward ~ 2x forward: twice the forward's emulated extra
        return hook

    def _backward_ends(self, i: int):
        """Hook on the stage's input: layer i, the first of the chunk, has finished its backward."""
        def hook(grad):
            if i in self._bwd_start:
                self.bwd[i] += time.perf_counter() - self._bwd_start.pop(i)
        return hook

    def layer_seconds(self) -> dict:
        return {i: self.fwd[i] + self.bwd[i] for i in self.fwd}


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


@dataclass
class PipelineRun:
    """What ``train_pipeline_balanced`` returns on every rank."""
    stage: ProfiledStage
    losses: list = field(default_factory=list)
    step_seconds: list = field(default_factory=list)   # wall time per step (the slowest stage's pace)
    bounds: list = field(default_factory=list)         # the partition each step ran with
    layer_seconds: list = field(default_factory=list)  # per step: agreed fwd+bwd seconds of every layer
    moves: list = field(default_factory=list)          # (after step, old, new, bytes moved in all, seconds)


def train_pipeline_balanced(comm, cfg, batches, microbatches: int = 4, lr: float = 0.1,
                            optimizer: str = "sgd", slow=None, balance: bool = True, every: int = 2,
                            window: int = 2, margin: float = 0.1, memory_cap: float | None = None,
                            bandwidth: float = 1e9, plan=None, on_step=None) -> PipelineRun:
    """Train ``GPT(cfg)`` as a ``comm.size``-stage 1F1B pipeline, re-partitioned while it runs.

    Starts from the uniform cut. Every ``every`` steps: the min-max cut of the window's median layer
    costs (within ``memory_cap`` bytes per stage, if given) replaces the current one if it predicts a
    slowest stage shorter by more than ``margin`` and ``pays_off`` (move time = bytes / ``bandwidth``).
    ``plan(step)`` (tests): the bounds to use from that step on (or None to keep them), instead."""
    if cfg.dropout:
        raise ValueError(f"rank {comm.rank}: re-partitioning needs dropout=0 (got {cfg.dropout}): the serial "
                         "twin draws dropout masks from one stream, the stages from their own")
    slow = Slowdown() if slow is None else slow if isinstance(slow, Slowdown) else Slowdown(slow)
    p, model = comm.size, GPT(cfg)
    n = len(model)
    slow.check_world(p, n, comm.rank)
    bounds = partition_uniform(n, p)
    stage = ProfiledStage(model, bounds, comm.rank, p, slow=slow)
    opt = make_optimizer(optimizer, stage.parameters(), lr)
    instructions = make_schedule("1f1b", p, microbatches)[comm.rank]
    run = PipelineRun(stage=stage)
    history = []
    for step, (x, y) in enumerate(batches):
        stage.step = step
        stage.reset()
        xs = split_microbatches(x, microbatches, comm.rank)
        ys = split_microbatches(y, microbatches, comm.rank)
        weights = token_loss_weights(ys, int((np.asarray(y) != -1).sum()), 1)

        def optimizer_step(opt=opt):
            opt.step()
            opt.zero_grad()

        t0 = time.perf_counter()
        stats = run_schedule(stage, comm, instructions, xs, ys, optimizer_step, loss_weights=weights)
        mine = np.zeros(2 * n)
        for i, s in stage.layer_seconds().items():
            mine[i] = s
            layer = model[i]
            mine[n + i] = layer_memory_bytes(layer, optimizer, stage.act_bytes[i], min(microbatches, p))
        agreed = all_reduce(comm, mine, op="sum")
        run.step_seconds.append(time.perf_counter() - t0)
        run.losses.append(stats.loss)
        run.bounds.append(list(bounds))
        run.layer_seconds.append(agreed[:n].tolist())
        history.append(agreed)
        new = None
        if plan is not None:
            new = plan(step)
        elif balance and (step + 1) % every == 0 and step + 1 < len(batches):
            recent = np.median(history[-window:], axis=0)
            costs, memory = recent[:n], recent[n:]
            best = partition_balanced(costs, p, memory if memory_cap else None, memory_cap)
            t_now = step_time(stage_costs(bounds, costs), microbatches)
            t_new = step_time(stage_costs(best, costs), microbatches)
            moved = sum(memory[i] for i in range(n) if stage_of(bounds, i) != stage_of(best, i))
            if t_new < (1 - margin) * t_now and pays_off(t_now, t_new, len(batches) - step - 1,
                                                          moved / bandwidth):
                new = best
        if new is not None and list(map(tuple, new)) != list(map(tuple, bounds)):
            t1 = time.perf_counter()
            stage, opt, sent = move_layers(comm, model, bounds, [tuple(b) for b in new], opt,
                                           {"slow": slow}, optimizer, lr)
            seconds = time.perf_counter() - t1
            sent = int(all_reduce(comm, np.array([sent], np.int64), op="sum")[0])  # every stage's
            run.moves.append((step, list(bounds), [tuple(b) for b in new], sent, seconds))
            bounds = [tuple(b) for b in new]
        run.stage = stage
        if on_step is not None:
            on_step(step, run)
    # every stage's loss is only on the last one: share it
    run.losses = [float(v) for v in comm.bcast_obj(run.losses, root=p - 1)]
    return run


def _slots(optimizer: str) -> int:
    """Arrays of optimizer state per parameter (SGD here has no momentum: 0; AdamW: m and v)."""
    return 2 if optimizer == "adamw" else 0


def layer_memory_bytes(layer, optimizer: str, act_bytes: float, in_flight: int) -> float:
    """What a layer costs the stage that holds it (the memory cap's unit, and what a move sends): its
    parameters and their optimizer state, plus the activations of the ``in_flight`` microbatches 1F1B
    keeps on the first stage (min(m, p)); ``act_bytes`` per microbatch."""
    return sum(q.data.nbytes for q in layer.parameters()) * (1 + _slots(optimizer)) + act_bytes * in_flight


def gather_stage_states(comm, run: PipelineRun) -> dict | None:
    """The whole model's parameters (serial names) on rank 0, from each stage's current layers."""
    mine = {k: np.array(q.backend.to_host(q.data)) for k, q in run.stage.named_parameters()}
    parts = comm.gather_obj(mine, 0)
    if parts is None:
        return None
    full = {}
    for part in parts:
        full.update(part)
    return full
