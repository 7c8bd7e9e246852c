"""The complete training state, saved and restored by one function pair: ``save`` and ``load``.

Everything that decides the next step goes in: parameters, optimizer state (moments and step
count), every object with a ``state_dict`` (data loader position, LR schedule, loss scaler,
sampler), every RNG stream (``minidist.autograd.random``'s generator -- dropout --, a tensor-parallel
``ShardedRNG``, any generator named in ``rngs``), the step, and the mesh it ran on. Arrays are
sharded (each rank writes only the pieces it owns; a piece held by several ranks -- a replicated
parameter -- is written by the lowest of them); small state is JSON in the manifest, per rank.

    state = TrainState(model, optimizer, objects={"loader": loader, "schedule": sched}, mesh=mesh)
    save(comm, "ckpt", step, state, keep=3)          # collective
    info = load(comm, "ckpt", state)                 # collective; info.step is the step to resume at
"""

from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import dataclass, field

from minidist.autograd import random as mrandom
from minidist.resilience.checkpoint import files, folder
from minidist.resilience.checkpoint.errors import CheckpointError
from minidist.resilience.checkpoint.layout import Slot, assemble, optimizer_slots, param_slots, zero_slots
from minidist.resilience.checkpoint.writer import (
    Snapshot,
    plan_file,
    prepare,
    snapshot,
    write_part,
    write_snapshot,
)

__all__ = ["Attrs", "LoadInfo", "Snapshot", "TrainState", "check_config", "load", "plan_file", "prepare",
           "restore", "save", "snapshot", "warn_skipped", "write_part", "write_snapshot"]


@dataclass
class TrainState:
    """What a training job is made of, for ``save``/``load``.

    ``model``: a Module or PipelineStage (anything with ``named_parameters()`` giving the serial
    names). ``optimizer``: a ``minidist.nn.optim`` optimizer over the model's parameters (None with
    ``zero``). ``zero``: a ``ZeRO`` wrapper, whose owned slices and optimizer are saved instead.
    ``slices``: {parameter name: (global shape, axis, [(lo, hi), ...])} for each parameter that is a
    piece of a larger tensor -- a tensor-parallel shard, as ``minidist.parallel.tensor.slices.
    global_slices`` describes it; the others are whole. ``objects``: name -> object
    with ``state_dict``/``load_state_dict``. ``rngs``: name -> numpy Generator (restored in place).
    ``mesh``: recorded in the manifest, e.g. {"dp": 2, "pp": 2, "tp": 1, "zero": 0}. ``on_load``:
    functions called after a restore (mixed precision: copy the fp32 masters into the model).
    ``config``: the model's configuration (JSON), recorded; a checkpoint of another configuration is
    refused at load, naming both. ``job``: the job's id (default ``MINIDIST_JOB_ID``, which the
    supervisor sets); a checkpoint folder belongs to one job (folder.py): another job's is refused.
    """

    model: object
    optimizer: object = None
    zero: object = None
    slices: dict = field(default_factory=dict)
    objects: dict = field(default_factory=dict)
    rngs: dict = field(default_factory=dict)
    mesh: dict = field(default_factory=dict)
    on_load: list = field(default_factory=list)  # called after a restore (e.g. recast fp32 masters)
    config: dict | None = None
    job: str | None = field(default_factory=lambda: os.environ.get("MINIDIST_JOB_ID"))

    def slots(self, optim_keys=None) -> tuple[list[Slot], list]:
        """(slots, finishers). ``optim_keys``: optimizer state keys (default: those it has now)."""
        if self.zero is not None:
            z = self.zero
            keys = optim_keys if optim_keys is not None else sorted(
                {k for st in z.optimizer.state for k in st})
            names = {id(p): n for n, p in z.module.named_parameters()}
            slots, finishers = zero_slots(z, keys, names)
            frozen = [(n, p) for n, p in z.module.named_parameters() if not p.requires_grad]
            return slots + param_slots(frozen, {}), finishers
        ps = param_slots(self.model.named_parameters(), self.slices)
        slots = list(ps)
        if self.optimizer is not None:
            by_id = {id(p): s for (_, p), s in zip(self.model.named_parameters(), ps)}
            keys = optim_keys if optim_keys is not None else sorted(
                {k for st in self.optimizer.state for k in st})
            for s in optimizer_slots(self.optimizer, by_id, keys):
                if optim_keys is None and s.extra["key"] not in self.optimizer.state[s.extra["index"]]:
                    continue  # a parameter that never had a gradient has no state yet
                slots.append(s)
        return slots, []

    @property
    def _optimizer(self):
        return self.zero.optimizer if self.zero is not None else self.optimizer

    def small_state(self) -> dict:
        """This rank's JSON-able state: optimizer scalars, objects' state_dicts, RNG states."""
        opt = self._optimizer
        return {"optimizer": {"lr": opt.lr, "step_count": opt.step_count} if opt is not None else None,
                "objects": {k: o.state_dict() for k, o in self.objects.items()},
                "rngs": {"minidist.autograd.random": mrandom.get_state(),
                         **{k: g.bit_generator.state for k, g in self.rngs.items()}}}

    def load_small_state(self, st: dict, where: str = "the checkpoint") -> None:
        try:
            self._load_small_state(st)
        except CheckpointError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError) as e:
            raise CheckpointError(f"{where}: a rank's small state (optimizer scalars, loader, schedule, "
                                  f"RNG streams) does not load: {type(e).__name__}: {e}") from None

    def _load_small_state(self, st: dict) -> None:
        opt = self._optimizer
        if opt is not None and st["optimizer"] is not None:
            opt.lr, opt.step_count = st["optimizer"]["lr"], st["optimizer"]["step_count"]
        for k, o in self.objects.items():
            if k not in st["objects"]:
                raise CheckpointError(f"the checkpoint has no state for {k!r}; it has "
                                      f"{sorted(st['objects'])}")
            o.load_state_dict(st["objects"][k])
        mrandom.set_state(st["rngs"]["minidist.autograd.random"])
        for k, g in self.rngs.items():
            if k in st["rngs"]:
                g.bit_generator.state = st["rngs"][k]


# -- save (writer.py writes) and load ---------------------------------------------------------------

def save(comm, root, step: int, state: TrainState, keep: int = 3, fault=None) -> str:
    """Save the whole training state as checkpoint ``step`` (collective). Returns its directory."""
    return write_snapshot(comm, root, snapshot(comm, step, state), keep, fault)


@dataclass
class LoadInfo:
    """What ``load`` found: the step to resume at, where from, what was skipped, how long it took."""

    step: int | None
    path: list | None     # the step directories its files were read from (one, or one per tier)
    problems: list
    resharded: bool
    seconds: float


def load(comm, root, state: TrainState, required: bool = False) -> LoadInfo:
    """Restore the newest intact checkpoint under ``root`` into ``state`` (collective).

    Damaged checkpoints are skipped (``info.problems`` says why). Without any, nothing changes and
    ``info.step`` is None (or CheckpointError if ``required``). On another mesh the arrays are
    resharded; per-rank small state (RNG streams, loader) then comes from the saved rank 0."""
    t0 = time.perf_counter()
    folder.check_owner(comm, root, state.job)
    where, manifest, problems = files.choose(comm, root, job=state.job, any_job=False)
    warn_skipped(comm, problems, manifest)
    if where is None:
        if required:
            raise CheckpointError(f"rank {comm.rank}: no intact checkpoint under {root}: {problems}")
        return LoadInfo(None, None, problems, False, time.perf_counter() - t0)
    resharded = restore(comm, where, manifest, state)
    return LoadInfo(manifest["step"], sorted(set(where.values())), problems, resharded,
                    time.perf_counter() - t0)


def restore(comm, where, manifest: dict, state: TrainState) -> bool:
    """Fill ``state`` from a verified checkpoint (``where``: its directory, or file -> directory as
    ``files.choose`` gives it). Collective. True if it was written on another mesh (then the arrays
    were resharded and per-rank small state is the saved rank 0's)."""
    path = where if isinstance(where, str) else sorted(set(where.values()))[0]
    dir_of = (lambda f: where) if isinstance(where, str) else where.__getitem__
    check_config(manifest, state, path)
    tensors = manifest["tensors"]
    keys = sorted({n.split("/")[1] for n in tensors if n.startswith("optim/")})
    slots, finishers = state.slots(optim_keys=keys)
    have = {s.name for s in slots if s.name.startswith("model/")}
    everyone = set().union(*comm.allgather_obj(have))
    saved = {n for n in tensors if n.startswith("model/")}
    if everyone != saved:
        raise CheckpointError(f"rank {comm.rank}: the checkpoint {path} is for another model: parameters "
                              f"only in the checkpoint {sorted(saved - everyone)[:4]}, only in this model "
                              f"{sorted(everyone - saved)[:4]}")
    cache: dict = {}

    def read(piece):
        k = (piece["file"], piece["offset"], piece["nbytes"])
        if k not in cache:
            cache[k] = files.read_piece(dir_of(piece["file"]), piece)
        return cache[k]

    for s in slots:
        if s.name not in tensors:
            if s.name.startswith("optim/"):
                continue  # no state saved for it (a parameter that had no gradient yet)
            raise CheckpointError(f"rank {comm.rank}: {s.name} is not in the checkpoint {path}")
        s.set(assemble(s, tensors[s.name], read))
    for f in finishers:
        f()
    same = manifest["mesh"] == dict(state.mesh, world=comm.size)
    state.load_small_state(manifest["ranks"][comm.rank if same else 0], os.path.join(path, files.MANIFEST))
    z = state.zero
    if z is not None and z.stage < 3:
        for b in z.buckets:
            z._gather_bucket(b)
    for f in state.on_load:
        f()
    return not same


def check_config(manifest: dict, state: TrainState, path) -> None:
    """Refuse a checkpoint saved from another model configuration, naming both (shapes may agree:
    n_head=2 and n_head=4 have the same parameters). Another mesh is fine: it is resharded."""
    saved, mine = manifest.get("config"), state.config
    mine = json.loads(json.dumps(mine)) if mine is not None else None  # as saved: tuples are lists
    if saved is None or mine is None or saved == mine:
        return
    keys = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k))
    both = ", ".join(f"{k}={saved.get(k)!r} (checkpoint) vs {mine.get(k)!r} (this model)" for k in keys)
    raise CheckpointError(f"{path} was saved from another model configuration: {both}; build the model "
                          "with the configuration it was saved with")


def warn_skipped(comm, problems, manifest) -> None:
    """(Rank 0) a warning for every damaged or foreign checkpoint skipped: a fallback is never silent."""
    if problems and comm.rank == 0:
        to = f"step {manifest['step']}" if manifest is not None else "no checkpoint (a fresh start)"
        warnings.warn(f"checkpoint: skipped {len(problems)}, using {to}: {'; '.join(problems)}",
                      files.CheckpointWarning, stacklevel=3)


class Attrs:
    """Named attributes of any object as checkpointable state: ``Attrs(sampler, "epoch", "seed")``
    (a ``DistributedSampler``'s shuffle is a function of its seed and epoch)."""

    def __init__(self, obj, *names: str):
        self.obj, self.names = obj, names

    def state_dict(self) -> dict:
        return {n: getattr(self.obj, n) for n in self.names}

    def load_state_dict(self, sd: dict):
        for n in self.names:
            setattr(self.obj, n, sd[n])
