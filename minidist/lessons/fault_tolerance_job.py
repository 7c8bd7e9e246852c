"""The job chapter 10 kills and resumes: a small GPT learning to sort, on any mesh, built by ``parallelize``.

``MeshTrainer(comm, cfg, dp=2, pp=2, tp=1)`` builds the model with ``parallelize`` (a GPT or a
tensor-parallel GPT, cut into pipeline stages, DDP over the data-parallel group -- or, with
``zero=1|2|3``, a ZeRO data-parallel GPT), AdamW, a warmup-cosine schedule, a seeded resumable
loader of global batches and per-rank dropout streams, and hands them to ``minidist.resilience``'s
``Trainer`` as a step function and a ``TrainState``: the loop there knows none of these techniques.
``full_state`` / ``full_parameters`` gather the trained state with each technique's own tools, not
with the checkpoint code, so tests can hold a checkpoint against them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from minidist.accel.backend import to_host
from minidist.autograd import random as mrandom
from minidist.comm import Mesh
from minidist.nn import GPTConfig
from minidist.nn.data import BatchLoader, SyntheticTask
from minidist.nn.optim import WarmupCosine
from minidist.parallel.parallelize import parallelize
from minidist.parallel.tensor.sharding import sharding_table, unshard
from minidist.parallel.tensor.slices import global_slices
from minidist.resilience.checkpoint import TrainState
from minidist.resilience.trainer import Trainer


def small_config(dtype: str = "float64", dropout: float = 0.1, n_layer: int = 2) -> GPTConfig:
    """A GPT for the sort task (vocabulary 12, 8 tokens) small enough to train in milliseconds."""
    return GPTConfig(vocab_size=12, block_size=8, n_layer=n_layer, n_head=4, d_model=16, dropout=dropout,
                     dtype=dtype, seed=3)


class MeshTrainer(Trainer):
    """One rank of the sort job over ``dp x pp x tp = comm.size`` ranks (see the module docstring);
    ``job`` names the job whose checkpoints it writes and resumes (default ``MINIDIST_JOB_ID``)."""

    def __init__(self, comm, cfg: GPTConfig, dp: int | None = None, pp: int = 1, tp: int = 1, zero: int = 0,
                 microbatches: int = 2, batch_size: int = 8, lr: float = 3e-3, total_steps: int = 100,
                 data_seed: int = 0, job: str | None = None):
        dp = comm.size // (pp * tp) if dp is None else dp
        if zero and (pp > 1 or tp > 1):
            raise ValueError(f"rank {comm.rank}: zero={zero} is data parallel only here; use pp=1, tp=1 with "
                             f"ZeRO (got pp={pp}, tp={tp})")
        self.comm, self.cfg, self.mesh = comm, cfg, Mesh(comm, dp=dp, pp=pp, tp=tp)
        # dropout: one stream per replica and stage, the same on the ranks of a tensor-parallel group
        mrandom.manual_seed(1_000 + self.mesh.pp_rank * dp + self.mesh.dp_rank)
        par = self.par = parallelize(cfg, self.mesh, microbatches=microbatches, zero=zero or None,
                                     optimizer="adamw", lr=lr)
        self.optimizer = par.optimizer
        table = {k: s for prefix, layer in par.layers() for k, s in sharding_table(layer, prefix).items()}
        model = par.model if zero else par.stage
        sharded = getattr(par.model, "sharded_rng", None)
        state = TrainState(model=model, optimizer=par.optimizer, zero=par.dp if zero else None,
                           slices=global_slices(model.named_parameters(), table, self.mesh.tp_rank, tp),
                           rngs={"tp_sharded": sharded.generator} if sharded is not None else {},
                           mesh={"dp": dp, "pp": pp, "tp": tp, "zero": zero}, config=dataclasses.asdict(cfg))
        if job is not None:
            state.job = job
        task = SyntheticTask("sort", length=4, size=256, seed=data_seed)
        loader = BatchLoader(task, batch_size, seed=data_seed)
        super().__init__(self._step, state, loader, WarmupCosine(self.optimizer, warmup=2, total=total_steps))
        self.table = table

    def _step(self, x, y) -> float:
        """One step of ``parallelize``'s model; this replica's loss (last stage; else nan)."""
        loss = self.par.step(x, y).loss
        return float("nan") if loss is None else float(loss)

    def full_state(self) -> dict | None:
        """Parameters and optimizer state, full and under serial names (``model/<name>``,
        ``optim/<key>/<name>``), on rank 0 (None elsewhere). Collective."""
        comm, par = self.comm, self.par
        if self.state().zero is not None:
            z, out = par.dp, {}
            names = {id(p): n for n, p in z.module.named_parameters()}
            for i, (b, shard) in enumerate(zip(z.buckets, z.shards)):
                parts = {"model": shard.data, **{f"optim/{k}": v for k, v in z.optimizer.state[i].items()}}
                for key, arr in parts.items():
                    full = np.concatenate(z.comm.allgather_obj(np.asarray(to_host(arr))))[:b.numel]
                    out.update({f"{key}/{names[id(p)]}": v.copy() for p, v in zip(b.params, b.views(full))})
            return out if comm.rank == 0 else None
        local, table = {}, {}
        for i, (name, p) in enumerate(par.stage.named_parameters()):
            arrays = {"model": p.data, **{f"optim/{k}": v for k, v in self.optimizer.state[i].items()}}
            for key, arr in arrays.items():
                local[f"{key}/{name}"] = np.asarray(to_host(arr)).copy()
                table[f"{key}/{name}"] = self.table.get(name)
        if self.mesh.tp_size > 1:
            gathered = self.mesh.tp.gather_obj(local, root=0)
            local = dict(unshard(gathered, table)) if gathered is not None else {}
        first = self.mesh.dp_rank == 0 and self.mesh.tp_rank == 0  # one copy of each stage
        parts = comm.gather_obj(local if first else {}, root=0)
        return None if parts is None else {k: v for part in parts for k, v in part.items()}

    def full_parameters(self) -> dict | None:
        """Every parameter, full and under its serial name, on rank 0 (None on the others). Collective."""
        full = self.full_state()
        return None if full is None else {k[6:]: v for k, v in full.items() if k.startswith("model/")}
