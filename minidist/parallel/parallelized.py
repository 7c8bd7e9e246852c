"""``Parallelized``: what ``parallelize`` built on one rank, and its training step.

``step(x, y)`` takes a global batch (the same on every rank), keeps this replica's rows and this
context-parallel rank's tokens, weights the microbatches by their valid tokens
(``minidist.parallel.data.weights``: the sum over every replica and microbatch is the serial mean)
and runs the pipeline schedule -- or, under ZeRO, the microbatches one after another -- then the
update.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from minidist.accel.backend import to_host
from minidist.comm import all_reduce
from minidist.parallel.context.ring import shard_sequence
from minidist.parallel.data.sharded import ShardedDataParallel
from minidist.parallel.data.weights import token_loss_weights
from minidist.parallel.memory.fp8_step import fp8_step
from minidist.parallel.memory.precision import MixedPrecision
from minidist.parallel.pipeline.runtime import PipelineStage, StepStats, run_schedule, split_microbatches


@dataclass
class Parallelized:
    """What ``parallelize`` built on this rank; ``step(x, y)`` trains one global batch."""
    mesh: object
    model: object                      # this rank's whole model (TP shards, its experts)
    stage: PipelineStage | None        # the pipeline cut (None under ZeRO)
    dp: object                         # DDP or ZeRO over ``replicas`` (None: one replica)
    mp: MixedPrecision | None
    optimizer: object
    loss_fn: object                    # the base loss of the logits (vocabulary-parallel with TP)
    microbatches: int = 1
    instructions: list = field(default_factory=list)
    bounds: list = field(default_factory=list)
    experts: list = field(default_factory=list)
    layout: str = "zigzag"
    replicas: object = None
    fp8: bool = False                  # FP8 Linears: a step that met inf/NaN is skipped on every rank

    def optimizer_step(self) -> None:
        """Wait for the data-parallel gradients, average the experts', step (through the masters; with
        FP8, unless a layer met inf or NaN: ``fp8_step``)."""
        if isinstance(self.dp, ShardedDataParallel):
            self.dp.step()
            return
        if self.dp is not None:
            self.dp.wait_gradients()
        n = self.mesh.dp_size * self.mesh.cp_size
        for p in self.experts:  # each token's weight is dp*cp x its share, as for DDP's mean
            if p.grad is not None:
                p.grad = all_reduce(self.mesh.edp_cp, p.grad) / n
        if self.mp is not None:
            self.mp.step(self.optimizer)
            return
        if self.fp8:
            fp8_step(self.model, self.optimizer, groups=[self.mesh.world])
        else:
            self.optimizer.step()
        self.optimizer.zero_grad()

    def step(self, x, y) -> StepStats:
        """One training step on global batch (x, y): this replica's rows, this cp rank's tokens, the
        microbatches weighted by their valid tokens; ``loss`` is dp*cp x this replica's share."""
        mesh, m, x, y = self.mesh, self.microbatches, np.asarray(x), np.asarray(y)
        n_valid = int((y != -1).sum())
        n = x.shape[0] // mesh.dp_size  # this replica's rows
        x, y = x[mesh.dp_rank * n:(mesh.dp_rank + 1) * n], y[mesh.dp_rank * n:(mesh.dp_rank + 1) * n]
        if mesh.cp_size > 1:
            x, y = (shard_sequence(a, mesh.cp_rank, mesh.cp_size, self.layout) for a in (x, y))
        xs, ys = split_microbatches(x, m, mesh.world.rank), split_microbatches(y, m, mesh.world.rank)
        weights = token_loss_weights(ys, n_valid, mesh.dp_size * mesh.cp_size)
        if self.stage is None:
            return self._zero_step(xs, ys, weights)
        scale = 1.0 if self.mp is None else self.mp.scale  # the step may change it: read before
        stats = run_schedule(self.stage, mesh.pp, self.instructions, xs, ys, self.optimizer_step,
                             ddp=self.dp, loss_weights=weights)
        if stats.loss is not None and scale != 1.0:
            stats.loss /= scale
        return stats

    def _zero_step(self, xs, ys, weights) -> StepStats:
        """ZeRO (no pipeline): each microbatch's backward weighted by its valid tokens, the last syncs."""
        stats, total = StepStats(), 0.0
        for i, (x, y) in enumerate(zip(xs, ys)):
            loss = self.loss_fn(self.model(x), y)
            n = int((np.asarray(y) != -1).sum())
            if i < len(xs) - 1:
                with self.dp.no_sync():
                    self.dp.backward(loss, n_samples=n)
            else:
                self.dp.backward(loss, n_samples=n)
            total += float(to_host(loss.data)) * weights[i]
        self.optimizer_step()
        stats.loss = total
        return stats

    def layers(self) -> list:
        """(prefix, layer) of this rank's layers, prefixed with their index in the model."""
        if self.stage is None:
            return [(f"{i}.", layer) for i, layer in enumerate(self.model)]
        return [(f"{i}.", layer) for ids, layers in zip(self.stage.layer_ids, self.stage.chunks)
                for i, layer in zip(ids, layers)]

    def state(self) -> dict:
        """{serial-model name (before expert renaming): host array} of this rank's trained parameters:
        the fp32 masters under mixed precision, ZeRO's gathered parameters."""
        if isinstance(self.dp, ShardedDataParallel):
            return {k: np.asarray(to_host(v)) for k, v in self.dp.full_parameters().items()}
        named = list(self.stage.named_parameters())
        params = self.mp.master_params if self.mp is not None else [p for _, p in named]
        return {k: np.asarray(to_host(p.data)) for (k, _), p in zip(named, params)}

    def close(self) -> None:
        """Release the offloaded optimizer's threads and memory (a no-op otherwise)."""
        for o in (self.optimizer, getattr(self.dp, "optimizer", None)):
            if hasattr(o, "close"):
                o.close()
