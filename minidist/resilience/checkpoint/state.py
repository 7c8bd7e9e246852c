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

import contextlib
import json
import os
import shutil
import time
import warnings
from dataclasses import dataclass, field

import numpy as np

from minidist.autograd import random as mrandom
from minidist.comm.communicator import default_timeout
from minidist.parallel.tensor.sharding import sharding_table
from minidist.resilience.checkpoint import files, folder, integrity
from minidist.resilience.checkpoint.files import CheckpointError
from minidist.resilience.checkpoint.layout import Slot, assemble, optimizer_slots, param_slots, zero_slots


@dataclass
class TrainState:
    """What a training job is made of, for ``save``/``load``.

    ``model``: a Module or PipelineStage (anything with ``named_parameters()`` giving the serial
    names). ``optimizer``: a ``minidist.nn.optim`` optimizer over the model's parameters (None with
    ``zero``). ``zero``: a ``ZeRO`` wrapper, whose owned slices and optimizer are saved instead.
    ``tp``: the tensor-parallel group (None: no tensor parallelism); ``table``: the parameters'
    sharding table (default: ``minidist.parallel.tensor.sharding.sharding_table`` of the model, or of each
    layer of a pipeline stage). ``objects``: name -> object
    with ``state_dict``/``load_state_dict``. ``rngs``: name -> numpy Generator (restored in place).
    ``mesh``: recorded in the manifest, e.g. {"dp": 2, "pp": 2, "tp": 1, "zero": 0}. ``on_load``:
    functions called after a restore (mixed precision: copy the fp32 masters into the model).
    ``config``: the model's configuration (JSON), recorded; a checkpoint of another configuration is
    refused at load, naming both. ``job``: the job's id; a checkpoint folder belongs to one job
    (folder.py), another job's checkpoints are skipped at load (default: ``MINIDIST_JOB_ID``).
    """

    model: object
    optimizer: object = None
    zero: object = None
    tp: object = None
    table: dict | None = None
    objects: dict = field(default_factory=dict)
    rngs: dict = field(default_factory=dict)
    mesh: dict = field(default_factory=dict)
    on_load: list = field(default_factory=list)  # called after a restore (e.g. recast fp32 masters)
    config: dict | None = None
    job: str | None = field(default_factory=lambda: os.environ.get("MINIDIST_JOB_ID"))

    def sharding(self) -> dict:
        """{parameter name: Shard or None} of the model (a PipelineStage: of the layers it holds)."""
        if self.table is not None:
            return self.table
        m = self.model
        if hasattr(m, "layer_ids"):  # a pipeline stage: its layers, under the full model's names
            return {k: s for ids, layers in zip(m.layer_ids, m.chunks) for i, layer in zip(ids, layers)
                    for k, s in sharding_table(layer, prefix=f"{i}.").items()}
        return dict(sharding_table(m))

    def slots(self, optim_keys=None) -> tuple[list[Slot], list]:
        """(slots, finishers). ``optim_keys``: optimizer state keys (default: those it has now)."""
        if self.zero is not None:
            z = self.zero
            keys = optim_keys if optim_keys is not None else sorted(
                {k for st in z.optimizer.state for k in st})
            names = {id(p): n for n, p in z.module.named_parameters()}
            slots, finishers = zero_slots(z, keys, names)
            frozen = [(n, p) for n, p in z.module.named_parameters() if not p.requires_grad]
            return slots + param_slots(frozen, {}, 0, 1), finishers
        part, parts = (self.tp.rank, self.tp.size) if self.tp is not None else (0, 1)
        ps = param_slots(self.model.named_parameters(), self.sharding() if parts > 1 else {}, part, parts)
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


# -- save -------------------------------------------------------------------------------------------

@dataclass
class Snapshot:
    """A rank's part of one checkpoint, copied to host memory: what the (background) writer needs."""

    step: int
    arrays: list          # host copies, in slot order
    specs: list           # (name, global shape, dtype, spec) per array
    small: dict
    mesh: dict
    seconds: float = 0.0  # how long the copy took (the training stall of an asynchronous save)
    job: str | None = None
    config: dict | None = None


def snapshot(comm, step: int, state: TrainState) -> Snapshot:
    """Copy this rank's owned pieces to host memory (collective: ranks agree who writes replicas)."""
    t0 = time.perf_counter()
    slots, _ = state.slots()
    keys = [s.key() for s in slots]
    first = {}
    for r, ks in enumerate(comm.allgather_obj(keys)):
        for k in ks:
            first.setdefault(k, r)
    mine = [s for s in slots if first[s.key()] == comm.rank]
    arrays = [np.array(s.get(), copy=True) for s in mine]
    specs = [(s.name, list(s.shape), np.dtype(s.dtype).str, s.spec()) for s in mine]
    mesh = dict(state.mesh, world=comm.size)
    return Snapshot(step, arrays, specs, state.small_state(), mesh, time.perf_counter() - t0, state.job,
                    state.config)


def plan_file(snap: Snapshot, rank: int) -> tuple[list[dict], bytes, int]:
    """(pieces, trailer, file size) of rank ``rank``'s file of ``snap`` -- known before a byte is
    written, so the space can be reserved and agreed on first."""
    pieces, offset = [], 0
    for a in snap.arrays:
        pieces.append({"offset": offset, "nbytes": a.nbytes, "dtype": a.dtype.str, "shape": list(a.shape)})
        offset += a.nbytes
    own = [{"name": name, "global_shape": shape, "global_dtype": dtype, **piece, **spec}
           for piece, (name, shape, dtype, spec) in zip(pieces, snap.specs)]
    tail = integrity.trailer_bytes(json.loads(json.dumps(
        {"rank": rank, "small": snap.small, "pieces": own, "step": snap.step, "job": snap.job,
         "config": snap.config, "mesh": snap.mesh})))
    return pieces, tail, offset + len(tail)


def _what(step: int, rank: int) -> str:
    return f"rank {rank}"


def _err(e: Exception) -> tuple[str, bool]:
    return str(e), isinstance(e, folder.CheckpointSpaceError)


def _raise(err: tuple[str, bool], prefix: str = ""):
    cls = folder.CheckpointSpaceError if err[1] else CheckpointError
    raise cls(prefix + err[0])


def prepare(comm, root, step: int, fault=None, job=None) -> str:
    """The empty temporary directory of checkpoint ``step`` (collective: rank 0 claims ``root`` for
    ``job`` -- folder.py -- and makes it, all get it, or all raise the same CheckpointError)."""
    tmp, err = None, None
    if comm.rank == 0:
        where = os.path.join(root, files.step_dir_name(step) + ".tmp")
        try:
            if os.path.isdir(root):
                folder.check_writable(root)
            if fault is not None:
                fault.before_create(where)
            folder.claim(root, job)
            tmp = files.begin_step(root, step)
        except CheckpointError as e:
            err = _err(e)
        except OSError as e:
            err = _err(folder.space_error(e, where, 0, _what(step, 0)))
    tmp, err = comm.bcast_obj((tmp, err), root=0)
    if err:
        _raise((f"checkpoint of step {step} not written ({err[0]}); the previous one stays the latest",
                err[1]), f"rank {comm.rank}: ")
    return tmp


def write_file(tmp, rank: int, snap: Snapshot, fault=None, writer: int | None = None,
               reserve: bool = True) -> dict:
    """Reserve (unless done already), write and fsync rank ``rank``'s file; its account for the
    manifest, with ``error`` set (and no file left) if it could not be written."""
    fname = files.rank_file_name(rank)
    path = os.path.join(tmp, fname)
    pieces, tail, need = plan_file(snap, rank)
    try:
        if reserve:
            folder.reserve(path, need, fault)
        _, meta = files.write_pieces(path, snap.arrays, fault, trailer=lambda _: tail)
        meta["writer"] = rank if writer is None else writer
        if fault is not None:
            fault.after_write(path)
        return {"file": fname, "meta": meta, "pieces": pieces, "specs": snap.specs, "small": snap.small,
                "error": None}
    except OSError as e:
        err = folder.space_error(e, path, need, _what(snap.step, rank))
        with contextlib.suppress(OSError):
            os.remove(path)  # free what it took, so the others' accounts (and the note) still fit
        return {"file": fname, "error": str(err), "space": isinstance(err, folder.CheckpointSpaceError)}


def _commit(root, tmp, snap: Snapshot, parts, keep: int, writer: int) -> tuple[str | None, tuple | None]:
    """(Rank 0) commit when every rank's file is whole; else remove ``tmp``. (directory, error)."""
    errors = [p for p in parts if p.get("error")]
    if not errors:
        try:
            m = integrity.seal(dict(_manifest(snap, parts), committed_by=writer))
            return files.commit_step(root, snap.step, m, keep), None
        except OSError as e:
            errors = [{"error": str(folder.space_error(e, os.path.join(tmp, files.MANIFEST), 0,
                                                        _what(snap.step, 0))), "space": True}]
    shutil.rmtree(tmp, ignore_errors=True)
    msg = f"checkpoint of step {snap.step} not written ({'; '.join(p['error'] for p in errors)}); " \
          "the previous one stays the latest"
    return None, (msg, any(p.get("space") for p in errors))


def write_part(root, tmp, rank: int, world: int, snap: Snapshot, keep: int = 3, fault=None,
               timeout: float | None = None, writer: int | None = None, reserved: bool = False) -> str | None:
    """Write rank ``rank``'s file and its sidecar into ``tmp`` -- no communication, so a background
    thread may run it while training goes on. The writer of rank 0's file then waits (at most
    ``timeout`` s, default ``MINIDIST_TIMEOUT``) for every sidecar and commits the checkpoint
    (manifest, rename, ``latest``); it returns the directory (other writers: None). ``writer``: the
    rank doing the writing, if not ``rank`` itself (a peer tier), recorded in the manifest.
    ``reserved``: the file's space was reserved already."""
    writer = rank if writer is None else writer
    side = write_file(tmp, rank, snap, fault, writer, reserve=not reserved)
    try:
        files.write_sidecar(tmp, rank, side)
    except OSError:
        with contextlib.suppress(OSError):
            open(os.path.join(tmp, f"rank-{rank:05d}.failed"), "w").close()
    if rank != 0:
        return None
    try:
        parts = files.wait_sidecars(tmp, world, default_timeout() if timeout is None else timeout)
    except CheckpointError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    final, err = _commit(root, tmp, snap, parts, keep, writer)
    if err:
        _raise(err)
    return final


def write_snapshot(comm, root, snap: Snapshot, keep: int = 3, fault=None) -> str:
    """Write a snapshot as checkpoint ``step`` under ``root``, now (collective, atomic; see files.py).
    The ranks' accounts go to rank 0 by message; it commits only if every file is whole, and every
    rank returns the directory or raises the same CheckpointError (disk full, read-only: naming the
    path and the bytes needed); the failed step's files are removed, the previous one stays."""
    tmp = prepare(comm, root, snap.step, fault, snap.job)
    parts = comm.gather_obj(write_file(tmp, comm.rank, snap, fault), root=0)
    final, err = _commit(root, tmp, snap, parts, keep, 0) if comm.rank == 0 else (None, None)
    final, err = comm.bcast_obj((final, err), root=0)
    if err:
        _raise(err, f"rank {comm.rank}: ")
    return final


def _manifest(snap: Snapshot, parts) -> dict:
    tensors, file_meta, ranks = {}, {}, []
    for p in parts:
        file_meta[p["file"]] = p["meta"]
        ranks.append(p["small"])
        for piece, (name, shape, dtype, spec) in zip(p["pieces"], p["specs"]):
            t = tensors.setdefault(name, {"shape": shape, "dtype": dtype, "pieces": []})
            t["pieces"].append({"file": p["file"], **piece, **spec})
    return {"format": files.FORMAT, "step": snap.step, "mesh": snap.mesh, "time": time.time(),
            "job": snap.job, "config": snap.config,
            "files": file_meta, "tensors": dict(sorted(tensors.items())), "ranks": ranks}


def save(comm, root, step: int, state: TrainState, keep: int = 3, fault=None) -> str:
    """Save the whole training state as checkpoint ``step`` (collective). Returns its directory."""
    return write_snapshot(comm, root, snapshot(comm, step, state), keep, fault)


# -- load -------------------------------------------------------------------------------------------

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
