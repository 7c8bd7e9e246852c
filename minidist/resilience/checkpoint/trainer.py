"""A resumable training job on any mesh: the thing a checkpoint saves and a restart resumes.

``Trainer(comm, cfg, dp=2, pp=2, tp=1)`` builds the 3D pieces of ``minidist.parallel.three_d`` (a
GPT or tensor-parallel GPT, cut into pipeline stages, DDP over the data-parallel group) -- or, with
``zero=1|2|3``, a ZeRO data-parallel GPT -- plus AdamW, a warmup-cosine schedule, a seeded
resumable loader of global batches, and per-rank dropout streams; ``job`` names the job whose
checkpoints it writes and resumes. ``trainer.step()`` trains one
step; ``trainer.state()`` is everything ``minidist.resilience.checkpoint.save`` needs to resume it exactly.
"""

from __future__ import annotations

import dataclasses
import os
import types

import numpy as np

from minidist.autograd import random as mrandom
from minidist.comm import Mesh
from minidist.nn import GPTConfig
from minidist.nn.data import BatchLoader, SyntheticTask
from minidist.nn.optim import AdamW, WarmupCosine
from minidist.parallel.data.ddp import DistributedDataParallel
from minidist.parallel.data.zero import ZeRO, all_gather_flat
from minidist.parallel.pipeline.catalog import make_schedule
from minidist.parallel.pipeline.partition import partition_uniform
from minidist.parallel.pipeline.runtime import run_schedule, split_microbatches
from minidist.parallel.pipeline.stage import PipelineStage
from minidist.parallel.tensor.sharding import unshard
from minidist.parallel.three_d import build_model, check_3d, gather_full_state, token_loss_weights
from minidist.resilience.checkpoint.state import TrainState


def small_config(dtype: str = "float64", dropout: float = 0.1, n_layer: int = 2) -> GPTConfig:
    """A GPT for the sort task (vocabulary 12, 8 tokens) small enough to train in milliseconds."""
    return GPTConfig(vocab_size=12, block_size=8, n_layer=n_layer, n_head=4, d_model=16, dropout=dropout,
                     dtype=dtype, seed=3)


class Trainer:
    """One rank of a training job over ``dp x pp x tp = comm.size`` ranks (see the module docstring)."""

    def __init__(self, comm, cfg: GPTConfig, dp: int | None = None, pp: int = 1, tp: int = 1, zero: int = 0,
                 microbatches: int = 2, batch_size: int = 8, lr: float = 3e-3, total_steps: int = 100,
                 data_seed: int = 0, job: str | None = None):
        dp = comm.size // (pp * tp) if dp is None else dp
        check_3d(comm.size, cfg, batch_size, dp, pp, tp, microbatches, 1, comm.rank)
        if zero and (pp > 1 or tp > 1):
            raise ValueError(f"rank {comm.rank}: zero={zero} is data parallel only here; use pp=1, tp=1 with "
                             f"ZeRO (got pp={pp}, tp={tp})")
        self.comm, self.cfg, self.microbatches, self.zero_stage = comm, cfg, microbatches, zero
        self.mesh = Mesh(comm, dp=dp, pp=pp, tp=tp)
        # dropout: one stream per replica and stage, the same on the ranks of a tensor-parallel group
        mrandom.manual_seed(1_000 + self.mesh.pp_rank * dp + self.mesh.dp_rank)
        model, loss_fn = build_model(cfg, self.mesh.tp)
        self.model, self.loss_fn = model, loss_fn
        self.zero = self.ddp = None
        if zero:
            self.zero = ZeRO(model, self.mesh.dp, lambda ps: AdamW(ps, lr=lr, weight_decay=0.0), stage=zero)
            self.optimizer, self.stage = self.zero.optimizer, None
        else:
            self.stage = PipelineStage(model, partition_uniform(len(model), pp), self.mesh.pp_rank, pp,
                                       loss_fn=loss_fn)
            self.optimizer = AdamW(self.stage.parameters(), lr=lr, weight_decay=0.0)
            self.instructions = make_schedule("1f1b", pp, microbatches)[self.mesh.pp_rank]
            if dp > 1:
                self.ddp = DistributedDataParallel(self.stage, self.mesh.dp, broadcast_from=None)
        self.schedule = WarmupCosine(self.optimizer, warmup=2, total=total_steps)
        self.loader = BatchLoader(SyntheticTask("sort", length=4, size=256, seed=data_seed), batch_size,
                                  seed=data_seed)
        self.step_count, self.losses = 0, []
        self.job = job if job is not None else os.environ.get("MINIDIST_JOB_ID")  # whose checkpoints

    def state(self) -> TrainState:
        sharded = getattr(self.model, "sharded_rng", None)
        model = self.stage if self.stage is not None else self.model
        return TrainState(model=model, optimizer=self.optimizer,
                          zero=self.zero, tp=self.mesh.tp if self.mesh.tp_size > 1 else None,
                          objects={"loader": self.loader, "schedule": self.schedule, "trainer": self},
                          rngs={"tp_sharded": sharded.generator} if sharded is not None else {},
                          mesh={"dp": self.mesh.dp_size, "pp": self.mesh.pp_size, "tp": self.mesh.tp_size,
                                "zero": self.zero_stage},
                          config=dataclasses.asdict(self.cfg), job=self.job)

    # the trainer's own state: the step counter (an object of the checkpoint like the loader)
    def state_dict(self) -> dict:
        return {"step": self.step_count}

    def load_state_dict(self, sd: dict):
        self.step_count = sd["step"]

    def step(self) -> float:
        """Train one step on the next global batch; returns this replica's loss (last stage; else nan)."""
        x, y = self.loader.next_batch()
        rows = x.shape[0] // self.mesh.dp_size
        mine = slice(self.mesh.dp_rank * rows, (self.mesh.dp_rank + 1) * rows)
        if self.zero is not None:
            loss = self.model.loss(x[mine], y[mine])
            self.zero.backward(loss)
            self.zero.step()
            value = float(loss.item())
        else:
            ddp, opt = self.ddp, self.optimizer

            def optimizer_step():
                if ddp is not None:
                    ddp.wait_gradients()
                opt.step()
                opt.zero_grad()

            xs = split_microbatches(x[mine], self.microbatches, self.comm.rank)
            ys = split_microbatches(y[mine], self.microbatches, self.comm.rank)
            weights = token_loss_weights(ys, int((np.asarray(y) != -1).sum()), self.mesh.dp_size)
            stats = run_schedule(self.stage, self.mesh.pp, self.instructions, xs, ys, optimizer_step, ddp=ddp,
                                 loss_weights=weights)
            value = float(stats.loss) if stats.loss is not None else float("nan")
        self.schedule.step()
        self.step_count += 1
        self.losses.append(value)
        return value

    def full_state(self) -> dict | None:
        """Parameters and optimizer state, full and under serial names (``model/<name>``,
        ``optim/<key>/<name>``), on rank 0 (None elsewhere). Collective. Gathered with each
        technique's own tools -- ZeRO's ``all_gather_flat``, the sharding table's ``unshard`` -- not
        with the checkpoint code, so tests can hold a checkpoint against it."""
        if self.zero is not None:
            z, out = self.zero, {}
            names = {id(p): n for n, p in z.module.named_parameters()}
            for i, (b, shard) in enumerate(zip(z.buckets, z.shards)):
                parts = {"model": shard.data, **{f"optim/{k}": v for k, v in z.optimizer.state[i].items()}}
                for key, arr in parts.items():
                    full = np.asarray(all_gather_flat(z.comm, arr, b.numel))
                    out.update({f"{key}/{names[id(p)]}": v.copy() for p, v in zip(b.params, b.views(full))})
            return out if self.comm.rank == 0 else None
        table, local = {}, {}
        shards = self.state().sharding() if self.mesh.tp_size > 1 else {}
        for i, (name, p) in enumerate(self.stage.named_parameters()):
            arrays = {"model": p.data, **{f"optim/{k}": v for k, v in self.optimizer.state[i].items()}}
            for key, arr in arrays.items():
                local[f"{key}/{name}"] = np.asarray(p.backend.to_host(arr)).copy()
                table[f"{key}/{name}"] = shards.get(name)
        if self.mesh.tp_size > 1:
            gathered = self.mesh.tp.gather_obj(local, root=0)
            local = dict(unshard(gathered, table)) if gathered is not None else {}
        first = self.mesh.dp_rank == 0 and self.mesh.tp_rank == 0  # one copy of each stage
        parts = self.comm.gather_obj(local if first else {}, root=0)
        return None if parts is None else {k: v for part in parts for k, v in part.items()}

    def full_parameters(self) -> dict | None:
        """Every parameter, full and under its serial name, on rank 0 (None on the others). Collective."""
        if self.zero is not None:
            full = {k: np.asarray(v).copy() for k, v in self.zero.full_parameters().items()}
            return full if self.comm.rank == 0 else None
        return gather_full_state(self.comm, types.SimpleNamespace(mesh=self.mesh, stage=self.stage))
