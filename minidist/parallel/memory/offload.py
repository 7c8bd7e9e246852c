"""Optimizer-state offload: AdamW's m and v live off the compute device, on disk or in host memory.

``OffloadedAdamW`` keeps each parameter's moments in ``numpy.memmap`` files (the NVMe offload of
ZeRO-Infinity; ``where="disk"``) or in host NumPy arrays (``where="host"``: what matters when the
parameters live on a GPU). The parameters are grouped into shards (``make_shards``: about
``shard_bytes`` of state each). The step walks the shards in order with a **background thread**
that prefetches shard n+1's state while shard n is updated, and writes shard n's state back while
n+1 is updated -- so at most three shards' state are resident at a time (``resident_peak``,
computed from the shard sizes), and the step waits on the disk only when the disk is slower than
the arithmetic. The update is ``minidist.nn.optim.adamw_update``, the one ``AdamW`` calls:
offloaded and in-memory AdamW give bit-identical parameters.

The files go to a fresh private folder inside ``offload_dir`` (checked first; None: the system
temporary directory) that ``close()`` deletes; ``offload_files.py`` makes it crash-safe. Chapter 8
(lessons/08-offload.md) has the timeline and the bytes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from minidist.accel.backend import backend_of
from minidist.autograd.tensor import current_saved_tensors_hooks, saved_tensors_hooks
from minidist.nn.optim import AdamW
from minidist.parallel.memory.offload_files import make_private_folder, reserved_memmap, untrack

KEYS = ("m", "v")


def check_offload_dir(path) -> str:
    """The directory as a string, or a clear error if it is missing, not a folder or unwritable."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"offload directory {path!r} does not exist; create it first "
                                f"(e.g. mkdir -p {path}) or pass an existing, writable folder")
    if not os.path.isdir(path):
        raise NotADirectoryError(f"offload directory {path!r} is a file, not a folder")
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(f"offload directory {path!r} is not writable by this process; "
                              "pass a folder you can write to")
    return path


def make_shards(nbytes: list, shard_bytes: int) -> list:
    """Consecutive parameter indices grouped into shards of about ``shard_bytes`` of state each (a
    parameter larger than that is a shard alone): one load / update / write-back per shard."""
    shards, cur, size = [], [], 0
    for i, b in enumerate(nbytes):
        if cur and size + b > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += b
    if cur:
        shards.append(cur)
    return shards


class _Done:
    """A finished future: what ``OffloadedAdamW._submit`` returns when there is no I/O thread."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


class OffloadedAdamW(AdamW):
    """AdamW with m and v kept in ``numpy.memmap`` files (``where="disk"``) or host memory ("host").

        with OffloadedAdamW(model.parameters(), "/tmp/offload", lr=1e-3) as opt:
            ... loss.backward(); opt.step(); opt.zero_grad() ...

    ``offload_params=True`` also moves the parameters themselves into the files (for the fp32
    master weights of mixed precision, ``MixedPrecision.master_params``, which only the optimizer
    reads): between steps each ``p.data`` is the memmap itself; NumPy parameters, disk only.
    ``offload_dir=None``: a private folder in the system temporary directory (deleted by ``close``).
    """

    def __init__(self, params, offload_dir=None, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                 where="disk", prefetch=True, shard_bytes=1 << 20, offload_params=False):
        super().__init__(params, lr, betas, eps, weight_decay)
        if where not in ("disk", "host"):
            raise ValueError(f"where must be 'disk' or 'host', got {where!r}")
        if isinstance(shard_bytes, bool) or not isinstance(shard_bytes, (int, np.integer)) or shard_bytes < 0:
            raise ValueError(f"OffloadedAdamW: shard_bytes must be an integer >= 0 (0: one shard per "
                             f"parameter), got {shard_bytes!r}")
        if offload_params and (where != "disk" or any(p.backend.name != "numpy" for p in self.params)):
            raise ValueError("offload_params=True needs where='disk' and NumPy parameters (the memmap *is* "
                             "the parameter between steps); offload only the optimizer state otherwise")
        self.keys = KEYS + (("p",) if offload_params else ())
        self.offload_params = offload_params
        self.shards = make_shards([len(self.keys) * p.data.nbytes for p in self.params], shard_bytes)
        self.where, self.prefetch, self.folder, self._store = where, prefetch, None, None
        self.resident_peak = 0  # most optimizer-state bytes in compute memory at once (from shard sizes)
        self.events = None  # set to [] to record spans: rank 0 = the step's thread, 1 = the I/O thread
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload") if prefetch else None
        if where == "host":
            self._store = [{k: np.zeros(p.shape, p.dtype) for k in KEYS} for p in self.params]
            return
        root = check_offload_dir(tempfile.gettempdir() if offload_dir is None else offload_dir)
        self.folder = make_private_folder(root, "minidist-adamw")
        try:
            self._store = [{k: reserved_memmap(os.path.join(self.folder, f"{i}.{k}"), p.dtype, p.shape)
                            for k in self.keys}
                           for i, p in enumerate(self.params)]
            if offload_params:
                for p, st in zip(self.params, self._store):
                    st["p"][...] = p.data
                    st["p"].flush()
        except BaseException:
            self.close()
            raise
        if offload_params:
            for p, st in zip(self.params, self._store):
                p.data = st["p"]

    # -- moving one shard's state in and out -------------------------------------------------------
    def _record(self, name, row, t0, n):
        if self.events is not None:
            self.events.append({"name": name, "cat": "compute", "rank": row, "t0": t0,
                                "t1": time.perf_counter(), "args": {"mb": n}})

    def _load(self, n, shard) -> list:
        t0 = time.perf_counter()
        out = [{k: self.params[i].backend.from_host(np.array(self._store[i][k])) for k in self.keys}
               for i in shard]
        self._record("Load", 1, t0, n)
        return out

    def _write(self, n, shard, states) -> None:
        t0 = time.perf_counter()
        for i, st in zip(shard, states):
            if self.offload_params:
                st["p"] = self.params[i].data  # the updated copy
            for k in self.keys:
                self._store[i][k][...] = self.params[i].backend.to_host(st[k])
            if self.offload_params:
                self.params[i].data = self._store[i]["p"]  # back to the file
        self._record("Write", 1, t0, n)

    def _submit(self, fn, *a):
        """Run ``fn(*a)`` on the I/O thread (a future), or now when there is none (a finished one)."""
        if self._pool is None:
            return _Done(fn(*a))
        return self._pool.submit(fn, *a)

    def step(self):
        if self._store is None:
            raise RuntimeError("OffloadedAdamW.step() after close(): its offload files are gone")
        self.step_count += 1
        shards = [[i for i in sh if self.params[i].grad is not None and self.params[i].requires_grad]
                  for sh in self.shards]
        shards = [sh for sh in shards if sh]
        if not shards:
            return
        sizes = [sum(len(self.keys) * self.params[i].data.nbytes for i in sh) for sh in shards]
        nxt, writes = self._submit(self._load, 0, shards[0]), []
        for n, shard in enumerate(shards):
            states = nxt.result()
            if n + 1 < len(shards):
                nxt = self._submit(self._load, n + 1, shards[n + 1])  # prefetch the next shard meanwhile
            # resident now: this shard, the one being prefetched, the one being written back
            window = sizes[max(0, n - 1): n + 2] if self._pool is not None else sizes[n: n + 1]
            self.resident_peak = max(self.resident_peak, sum(window))
            t0 = time.perf_counter()
            live = [(self.params[i], st) for i, st in zip(shard, states)]
            if self.offload_params:
                for p, st in live:
                    p.data = st.pop("p")  # update an in-memory copy; _write puts it back
            self.apply_updates(live)  # on JAX the shard's update is one compiled call, not one per tensor
            self._record("Update", 0, t0, n)
            writes.append(self._submit(self._write, n, shard, states))  # write back in the background
        for w in writes:
            w.result()

    # -- accounting, state, cleanup ---------------------------------------------------------------
    @property
    def offloaded_bytes(self) -> int:
        """Bytes kept off the compute device: m and v (and the parameters with ``offload_params``)."""
        return sum(len(self.keys) * p.data.nbytes for p in self.params)

    def memory_arrays(self) -> dict:
        """What stays in compute memory between steps, for ``minidist.nn.footprint.MemoryAccountant.report``:
        parameters and gradients; no optimizer state (during a step: ``resident_peak``)."""
        return {"params": [] if self.offload_params else [p.data for p in self.params],
                "grads": [p.grad for p in self.params], "optimizer_state": []}

    def state_dict(self) -> dict:
        """Same format as ``AdamW.state_dict`` (host copies), so checkpoints move between the two."""
        return {"lr": self.lr, "step_count": self.step_count,
                "state": [{k: np.array(s[k]) for k in KEYS} if self.step_count else {} for s in self._store]}

    def load_state_dict(self, sd: dict):
        if len(sd["state"]) != len(self.params):
            raise ValueError(f"optimizer state has {len(sd['state'])} entries, this optimizer has "
                             f"{len(self.params)} parameters")
        self.lr, self.step_count = sd["lr"], sd["step_count"]
        for s, st in zip(self._store, sd["state"]):
            for k in KEYS:
                s[k][...] = st[k] if k in st else 0
        return self

    def close(self):
        """Stop the background thread and delete the offload files."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self.offload_params and self._store is not None:
            for p in self.params:  # the parameters come back into memory before their files go
                if isinstance(p.data, np.memmap):
                    p.data = np.array(p.data)
        self._store = None
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            untrack(self.folder)
            self.folder = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# -- activation offload: what the forward saves for backward waits in host memory ------------------

class _OnHost:
    """A saved activation parked in host memory, and the backend to bring it back to."""

    __slots__ = ("array", "backend", "inner")

    def __init__(self, array, backend, inner):
        self.array, self.backend, self.inner = array, backend, inner


def offload_activations(module, min_bytes: int = 0):
    """Keep the activations ``module``'s forward saves for backward in host memory (PyTorch's
    ``save_on_cpu``): each saved array of at least ``min_bytes`` is copied to the host when saved
    and back to the device when backward reads it (parameters stay: they are state). On a GPU this
    trades transfers for device memory; on NumPy the copy is to the same memory (what is measured
    is the mechanism).

    It is a forward wrapper at the ``"offload"`` position of ``Module``'s stack: outside ZeRO-3, whose
    innermost saved-tensor hook turns parameters into references first, so only activations
    arrive here; inside recomputation, so a recomputation's activations are offloaded too. Returns
    the handle (``handle.remove()`` stops it)."""
    def wrapper(mod, inner, *args, **kwargs):
        outer = current_saved_tensors_hooks()
        params = {id(p.data) for p in mod.parameters()}  # state, not activations: never copied

        def pack(a):
            if id(a) in params or not hasattr(a, "nbytes") or a.nbytes < min_bytes:
                return _OnHost(None, None, outer[0](a) if outer else a)  # stays (an outer hook sees it)
            be = backend_of(a)
            return _OnHost(np.array(be.to_host(a)), be, None)  # a host copy; the device array can go

        def unpack(s):
            if s.array is None:
                return outer[1](s.inner) if outer else s.inner
            return s.backend.from_host(s.array)

        with saved_tensors_hooks(pack, unpack):
            return inner(*args, **kwargs)

    return module.register_forward_wrapper(wrapper, "offload", "activation offload")
