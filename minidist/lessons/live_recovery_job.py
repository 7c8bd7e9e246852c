"""The job chapter 10's live-recovery section runs, and its serial twin given a quorum sequence.

``LiveGPTJob(cfg, group, pos, groups, rows, pp=1, tp=1)`` is one member's job (see
``minidist.resilience.live.member``): its replica group's GPT built by ``parallelize`` on the group's
communicator with ``Options(live=quorum)``, AdamW, a seeded loader of global batches of
``groups x rows`` rows (group g trains on rows g*rows..), and a replicated RNG stream that draws each
step's dropout seed (group g's masks: ``default_rng([seed, g])``). Its ``TrainState`` -- parameters,
AdamW's m and v, the loader's position, the step count, the RNG streams -- is what a heal moves.

``quorum_twin`` is the serial twin: one GPT in one process; for each committed step, the gradient of
each participating group's rows, summed in group order, divided by their number, one AdamW step.
``LiveLocalSGDJob`` / ``local_sgd_twin``: the same with DiLoCo over the quorum (a GPT per group).
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np

from minidist.autograd import random as mrandom
from minidist.comm import Mesh
from minidist.nn import GPT, GPTConfig
from minidist.nn.data import BatchLoader, SyntheticTask
from minidist.nn.optim import make_optimizer
from minidist.nn.serial import host_state
from minidist.parallel.data.live.local_sgd import QuorumLocalSGD
from minidist.parallel.parallelize import Options, parallelize
from minidist.parallel.tensor.sharding import sharding_table
from minidist.parallel.tensor.slices import global_slices
from minidist.parallel.three_d import gather_full_state
from minidist.resilience.checkpoint import TrainState


def live_config(dropout: float = 0.1, dtype: str = "float64", n_layer: int = 2) -> GPTConfig:
    """The sort task's small GPT (vocabulary 12, 8 tokens)."""
    return GPTConfig(vocab_size=12, block_size=8, n_layer=n_layer, n_head=4, d_model=16, dropout=dropout,
                     dtype=dtype, seed=3)


def _task(data_seed: int):
    return SyntheticTask("sort", length=4, size=256, seed=data_seed)


class LiveGPTJob:
    """One member's share of the live job (see the module docstring)."""

    def __init__(self, cfg: GPTConfig, group: int, pos: int, groups: int, rows: int, pp: int = 1, tp: int = 1,
                 optimizer: str = "adamw", lr: float = 3e-3, data_seed: int = 0, seed: int = 0):
        self.cfg, self.group, self.pos, self.groups, self.rows = cfg, group, pos, groups, rows
        self.pp, self.tp, self.optimizer, self.lr = pp, tp, optimizer, lr
        self.data_seed, self.seed = data_seed, seed
        self.start_step, self.step_count, self.losses = 0, 0, []
        self.quorums: list = []  # each committed step's participating groups: saved, healed, restored

    def build(self, group_comm, quorum) -> None:
        self.comm, self.mesh = group_comm, Mesh(group_comm, pp=self.pp, tp=self.tp)
        opts = Options(pp=self.pp, tp=self.tp, live=quorum, optimizer=self.optimizer, lr=self.lr)
        par = self.par = parallelize(self.cfg, self.mesh, opts)
        table = {k: s for prefix, layer in par.layers() for k, s in sharding_table(layer, prefix).items()}
        self.loader = BatchLoader(_task(self.data_seed), self.groups * self.rows, seed=self.data_seed)
        self.rng = np.random.default_rng(self.seed)   # the same stream on every replica: each step's seed
        sharded = getattr(par.model, "sharded_rng", None)
        self.state = TrainState(
            model=par.stage, optimizer=par.optimizer,
            slices=global_slices(par.stage.named_parameters(), table, self.mesh.tp_rank, self.tp),
            objects={"loader": self.loader, "trainer": self},
            rngs={"job": self.rng, **({"tp_sharded": sharded.generator} if sharded is not None else {})},
            mesh={"pp": self.pp, "tp": self.tp}, config=dataclasses.asdict(self.cfg))

    def state_dict(self) -> dict:
        return {"step": self.step_count, "quorums": [list(q) for q in self.quorums]}

    def load_state_dict(self, sd: dict) -> None:
        self.step_count, self.quorums = sd["step"], [list(q) for q in sd["quorums"]]

    def committed(self, step: int, participants) -> None:
        self.quorums.append(list(participants))

    def begin_step(self, step: int):
        """This step's batch rows of this group, and its dropout stream (the same on every replica)."""
        x, y = self.loader.next_batch()
        seed = int(self.rng.integers(2 ** 62))
        mrandom.manual_seed([seed, self.group])
        self.step_count = step + 1
        rows = slice(self.group * self.rows, (self.group + 1) * self.rows)
        return x[rows], y[rows]

    def train_step(self, batch) -> None:
        self.losses.append(self.par.step(*batch).loss)

    def receive_step(self) -> None:
        self.par.optimizer_step()

    def local_state(self) -> dict:
        """This rank's arrays (parameters, optimizer state) and small state, host copies."""
        slots, _ = self.state.slots()
        return {"arrays": {s.name: np.array(s.get(), copy=True) for s in slots},
                "small": self.state.small_state()}

    def result(self) -> dict:
        """Collective over the group: this rank's state, and (group rank 0) the full parameters."""
        full = gather_full_state(self.comm, types.SimpleNamespace(mesh=self.mesh, parallel=self.par))
        return {"group": self.group, "pos": self.pos, "full": full, **self.local_state()}


def quorum_twin(cfg: GPTConfig, history, groups: int, rows: int, optimizer: str = "adamw", lr: float = 3e-3,
                data_seed: int = 0, seed: int = 0) -> dict:
    """The serial twin given the quorum sequence: ``history`` lists, per committed step in order, its
    participating groups (a ``StepRecord``, or the groups themselves). Returns {name: host array}."""
    model = GPT(cfg)
    params = list(model.parameters())
    opt = make_optimizer(optimizer, params, lr)
    loader = BatchLoader(_task(data_seed), groups * rows, seed=data_seed)
    rng = np.random.default_rng(seed)
    for rec in history:
        x, y = loader.next_batch()
        step_seed = int(rng.integers(2 ** 62))
        total = None
        participants = getattr(rec, "participants", rec)
        for g in sorted(participants):
            for p in params:
                p.grad = None
            mrandom.manual_seed([step_seed, g])
            model.loss(x[g * rows:(g + 1) * rows], y[g * rows:(g + 1) * rows]).backward()
            grads = [np.array(p.grad, copy=True) for p in params]
            total = grads if total is None else [t + g_ for t, g_ in zip(total, grads)]
        for p, t in zip(params, total):
            p.grad = t / len(participants)
        opt.step()
        opt.zero_grad()
    return {k: np.array(p.data, copy=True) for k, p in model.named_parameters()}


class LiveLocalSGDJob(LiveGPTJob):
    """DiLoCo over the quorum: each group a serial GPT with its own AdamW (inner), an outer Nesterov step
    every ``H`` steps over the groups present (``QuorumLocalSGD``)."""

    def __init__(self, cfg, group, pos, groups, rows, H: int = 3, outer_lr: float = 0.7,
                 momentum: float = 0.9, **kw):
        super().__init__(cfg, group, pos, groups, rows, **kw)
        self.H, self.outer_lr, self.momentum = H, outer_lr, momentum

    def build(self, group_comm, quorum) -> None:
        self.comm, self.model = group_comm, GPT(self.cfg)
        self.inner = make_optimizer(self.optimizer, self.model.parameters(), self.lr)
        self.outer = QuorumLocalSGD(self.model, quorum, self.inner, self.H, self.outer_lr, self.momentum)
        self.loader = BatchLoader(_task(self.data_seed), self.groups * self.rows, seed=self.data_seed)
        self.rng = np.random.default_rng(self.seed)
        self.state = TrainState(model=self.model, optimizer=self.inner,
                                objects={"loader": self.loader, "trainer": self, "outer": self.outer},
                                rngs={"job": self.rng}, config=dataclasses.asdict(self.cfg))

    def train_step(self, batch) -> None:
        loss = self.model.loss(*batch)
        loss.backward()
        self.outer.step()
        self.outer.zero_grad()
        self.losses.append(float(loss.item()))

    def receive_step(self) -> None:
        self.outer.receive_step()

    def local_state(self) -> dict:
        out = super().local_state()
        out["arrays"].update({f"outer/{k}": np.array(v, copy=True) for k, v in self.outer.arrays().items()})
        return out

    def result(self) -> dict:
        return {"group": self.group, "pos": self.pos, "full": host_state(self.model), **self.local_state()}


def local_sgd_twin(cfg: GPTConfig, history, groups: int, rows: int, H: int = 3, outer_lr: float = 0.7,
                   momentum: float = 0.9, lr: float = 3e-3, data_seed: int = 0, seed: int = 0) -> dict:
    """DiLoCo's serial twin given the quorum sequence: one GPT and AdamW per group in one process; a
    healed group starts the step from a copy of its donor's; every H steps the mean over the step's
    participants of (anchor - θ_g), summed in group order, makes the outer Nesterov step. Returns
    {group: {name: host array}} of the groups alive at the end."""
    models = {g: GPT(cfg) for g in range(groups)}
    opts = {g: make_optimizer("adamw", models[g].parameters(), lr) for g in range(groups)}
    anchor = np.concatenate([p.data.reshape(-1) for p in models[0].parameters()])
    velocity = np.zeros_like(anchor)
    loader = BatchLoader(_task(data_seed), groups * rows, seed=data_seed)
    rng, t = np.random.default_rng(seed), 0
    for rec in history:
        x, y = loader.next_batch()
        step_seed = int(rng.integers(2 ** 62))
        for h, d in rec.healing.items():  # the healer starts from its donor's start-of-step state
            for p, q in zip(models[h].parameters(), models[d].parameters()):
                p.data = q.data.copy()
            opts[h].state = [{k: v.copy() for k, v in st.items()} for st in opts[d].state]
            opts[h].step_count = opts[d].step_count
        for g in sorted(rec.participants):
            mrandom.manual_seed([step_seed, g])
            models[g].loss(x[g * rows:(g + 1) * rows], y[g * rows:(g + 1) * rows]).backward()
            opts[g].step()
            opts[g].zero_grad()
        t += 1
        if t % H:
            continue
        total = None
        for g in sorted(rec.participants):
            delta = anchor - np.concatenate([p.data.reshape(-1) for p in models[g].parameters()])
            total = delta if total is None else total + delta
        mean = total / len(rec.participants)
        velocity = momentum * velocity + mean
        anchor = anchor - outer_lr * (mean + momentum * velocity)
        for g in list(rec.participants) + list(rec.healing):
            offset = 0
            for p in models[g].parameters():
                p.data = anchor[offset:offset + p.size].reshape(p.shape).copy()
                offset += p.size
    alive = set(history[-1].participants) | set(history[-1].healing) if history else set()
    return {g: {k: np.array(p.data, copy=True) for k, p in models[g].named_parameters()} for g in alive}
