"""Grader for exercises/fault_tolerance.py: an atomic checkpoint save, and resharding on load.

``CHECKS[task](impl)`` raises AssertionError when ``impl.<task>`` is wrong. ``atomic_save`` is
crashed at every file operation in turn (each open, write, fsync, rename, mkdir: a ``Crash``, a
BaseException, so no ``except Exception`` swallows it); after each crash the grader's own reader
follows ``latest``, checks every sha256 and loads the arrays: they must be the previous checkpoint's
or the new one's, whole. ``load_shard`` is checked against ``np.split`` of random arrays, and the
old blocks it reads against interval arithmetic. In CI both run against minidist's own code
(``reference``: must pass) and the deliberately broken versions in ``BROKEN`` (must fail);
``python -m minidist.grade fault_tolerance`` runs them on a student's file.
"""

import builtins
import hashlib
import json
import os
import shutil
import tempfile
import types

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minidist.grading import untouched
from minidist.resilience.checkpoint import files
from minidist.resilience.checkpoint.layout import Slot, assemble

GRADE = settings(max_examples=15, deadline=None, derandomize=True, database=None, report_multiple_bugs=False)


# -- the grader's reader and crash injection ----------------------------------------------------------

def read_latest(root) -> dict:
    """The arrays of the checkpoint ``latest`` names, after checking it is whole (AssertionError if not)."""
    latest = os.path.join(root, "latest")
    assert os.path.exists(latest), "there is no root/latest"
    name = open(latest).read().strip()
    d = os.path.join(root, name)
    assert name.startswith("step-") and os.path.isdir(d), (
        f"latest says {name!r}, which is not a checkpoint directory")
    mpath = os.path.join(d, "manifest.json")
    assert os.path.exists(mpath), f"{name} has no manifest.json"
    try:
        manifest = json.load(open(mpath))
    except json.JSONDecodeError as e:
        raise AssertionError(f"{name}/manifest.json is not whole JSON: {e}") from None
    out = {}
    for fname, sha in manifest["files"].items():
        path = os.path.join(d, fname)
        assert os.path.exists(path), f"{name}/{fname} is missing"
        got = hashlib.sha256(open(path, "rb").read()).hexdigest()
        assert got == sha, f"{name}/{fname}: sha256 {got[:12]}... differs from the manifest's {sha[:12]}..."
        out[fname[:-4]] = np.load(path, allow_pickle=False)
    return out


class Crash(BaseException):
    """The process 'dies' here."""


class _File:
    """A file whose writes count as operations that may crash (the 1st, 2nd, 4th, 8th, ... write of
    each file: json.dump writes in many small pieces, and a crash mid-file is one case, not hundreds)."""

    def __init__(self, f, tick):
        self._f, self._tick, self._n = f, tick, 0

    def write(self, data):
        self._n += 1
        if self._n & (self._n - 1) == 0:
            self._tick("write")
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


class CrashAt:
    """Patch open/write/fsync/rename/replace/mkdir/makedirs so the ``k``-th of them raises Crash."""

    NAMES = ("fsync", "rename", "replace", "mkdir", "makedirs")

    def __init__(self, k):
        self.k, self.count, self.saved = k, 0, {}

    def tick(self, what):
        self.count += 1
        if self.count == self.k:
            raise Crash(f"crashed at operation {self.count} ({what})")

    def __enter__(self):
        real_open = builtins.open
        self.saved = {n: getattr(os, n) for n in self.NAMES}
        self.saved["open"] = real_open

        def fake_open(file, mode="r", *a, **kw):
            self.tick(f"open {os.path.basename(str(file))} {mode}")
            f = real_open(file, mode, *a, **kw)
            return _File(f, self.tick) if any(c in mode for c in "wax+") else f
        builtins.open = fake_open
        for n in self.NAMES:  # fsync is counted but not done: a crash here is a process dying, not the power
            real = self.saved[n] if n != "fsync" else (lambda fd: None)
            setattr(os, n, lambda *a, _r=real, _n=n, **kw: (self.tick(_n), _r(*a, **kw))[1])
        return self

    def __exit__(self, *exc):
        builtins.open = self.saved["open"]
        for n in self.NAMES:
            setattr(os, n, self.saved[n])


def _arrays(seed, n=3):
    rng = np.random.default_rng(seed)
    return {f"t{i}": rng.standard_normal((i + 1, 3)).astype(["float64", "float32"][i % 2]) for i in range(n)}


def _same(a, b):
    return a.keys() == b.keys() and all(x.dtype == b[k].dtype and np.array_equal(x, b[k])
                                        for k, x in a.items())


def check_atomic_save(impl):
    fast = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None  # hundreds of tiny crashed saves: RAM
    with tempfile.TemporaryDirectory(dir=fast) as tmp:
        root = os.path.join(tmp, "ckpt")
        old, new = _arrays(1), _arrays(2)
        untouched(impl.atomic_save)(root, 1, old)
        assert _same(read_latest(root), old), (
            "after atomic_save(root, 1, arrays) root/latest does not give arrays back")
        assert open(os.path.join(root, "latest")).read().strip() == "step-00000001"
        clean = os.path.join(tmp, "clean")
        shutil.copytree(root, clean)
        k = 1
        while True:  # crash at operation 1, 2, 3, ... until a save runs to the end
            shutil.rmtree(root)
            shutil.copytree(clean, root)
            try:
                with CrashAt(k) as c:
                    untouched(impl.atomic_save)(root, 2, new)
                crashed = None
            except Crash as e:
                crashed = str(e)
            try:
                got = read_latest(root)
            except AssertionError as e:
                raise AssertionError(f"after a crash at operation {k} ({crashed}): {e}") from None
            assert _same(got, old) or _same(got, new), (
                f"after a crash at operation {k} ({crashed}): latest holds neither the old arrays nor "
                "the new")
            if crashed is None:
                assert _same(got, new), "a save that finished left latest at the old checkpoint"
                break
            untouched(impl.atomic_save)(root, 2, new)  # the restarted job saves again over the leftovers
            assert _same(read_latest(root), new), (
                f"after a crash at operation {k}, saving step 2 again did not give the new arrays")
            k += 1
            assert k < 500, "atomic_save never finished"
        assert c.count >= 4, (
            f"atomic_save made only {c.count} file operations: it cannot be fsyncing and renaming")


def check_load_shard(impl):
    @GRADE
    @given(data=st.data())
    @example(data=None)  # the docstring's example, tried first
    def prop(data):
        if data is None:
            shape, axis, old, new, rank = (12,), 0, 3, 2, 1
        else:
            ndim = data.draw(st.integers(1, 3))
            axis = data.draw(st.integers(0, ndim - 1))
            old, new = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4))
            shape = tuple(old * new * data.draw(st.integers(1, 2)) if d == axis
                          else data.draw(st.integers(1, 3)) for d in range(ndim))
            rank = data.draw(st.integers(0, new - 1))
        full = np.random.default_rng(sum(shape) + 7 * old + new).standard_normal(shape)
        blocks = np.split(full, old, axis=axis)
        reads = []

        def read_piece(r):
            reads.append(r)
            return blocks[r].copy()
        what = f"load_shard(shape={shape}, axis={axis}, old_size={old}, new_rank={rank}, new_size={new})"
        got = np.asarray(untouched(impl.load_shard)(read_piece, shape, np.float64, axis, old, rank, new))
        want = np.split(full, new, axis=axis)[rank]
        assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
        assert np.array_equal(got, want), f"{what}: wrong values"
        n = shape[axis]
        lo, hi = rank * n // new, (rank + 1) * n // new
        need = [r for r in range(old) if r * n // old < hi and (r + 1) * n // old > lo]
        assert sorted(reads) == need, (
            f"{what}: read old blocks {sorted(reads)}; it needs exactly {need}, once each")
    prop()


CHECKS = {"atomic_save": check_atomic_save, "load_shard": check_load_shard}


# -- minidist's own implementation (must pass) ---------------------------------------------------

def reference():
    def atomic_save(root, step, arrays):
        tmp = files.begin_step(root, step)
        manifest = {"step": step, "files": {}}
        for name, a in arrays.items():
            path = os.path.join(tmp, f"{name}.npy")
            with open(path, "wb") as f:
                np.save(f, a)
                f.flush()
                os.fsync(f.fileno())
            manifest["files"][f"{name}.npy"] = files.sha256_file(path)
        files.commit_step(root, step, manifest, keep=2)

    def load_shard(read_piece, shape, dtype, axis, old_size, new_rank, new_size):
        def block(r, size):  # block r of ``size`` along ``axis``, as a checkpoint piece describes it
            n = shape[axis] // size
            return {"axis": axis, "ranges": [[r * n, (r + 1) * n]], "flat": None}

        pieces = [{"file": "", "offset": r, "nbytes": 0, **block(r, old_size)} for r in range(old_size)]
        slot = Slot("x", tuple(shape), np.dtype(dtype), None, None, axis, block(new_rank, new_size)["ranges"])
        tensor = {"shape": list(shape), "dtype": np.dtype(dtype).str, "pieces": pieces}
        return assemble(slot, tensor, lambda p: read_piece(p["offset"]))

    return types.SimpleNamespace(atomic_save=atomic_save, load_shard=load_shard)


# -- deliberately broken implementations (must fail) ---------------------------------------------

def _write_dir(d, arrays):
    os.makedirs(d, exist_ok=True)
    manifest = {"files": {}}
    for name, a in arrays.items():
        path = os.path.join(d, f"{name}.npy")
        with open(path, "wb") as f:
            np.save(f, a)
        manifest["files"][f"{name}.npy"] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    with open(os.path.join(d, "manifest.json"), "w") as f:
        json.dump(manifest, f)


def _in_place(root, step, arrays):  # no temporary directory, latest overwritten in place
    name = f"step-{step:08d}"
    _write_dir(os.path.join(root, name), arrays)
    with open(os.path.join(root, "latest"), "w") as f:
        f.write(name)


def _latest_first(root, step, arrays):  # atomic pieces in the wrong order: latest before the rename
    name, tmp = f"step-{step:08d}", os.path.join(root, f"step-{step:08d}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "latest.tmp"), "w") as f:
        f.write(name)
    os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
    _write_dir(tmp, arrays)
    shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    os.rename(tmp, os.path.join(root, name))


def _read_everything(read_piece, shape, dtype, axis, old_size, new_rank, new_size):  # right values, all reads
    full = np.concatenate([read_piece(r) for r in range(old_size)], axis=axis)
    return np.split(full, new_size, axis=axis)[new_rank]


def _same_rank(read_piece, shape, dtype, axis, old_size, new_rank, new_size):  # as if the mesh were unchanged
    return read_piece(new_rank % old_size)


def _inclusive_end(read_piece, shape, dtype, axis, old_size, new_rank, new_size):  # off by one at the edges
    n = shape[axis]
    lo, hi = new_rank * n // new_size, (new_rank + 1) * n // new_size
    parts = []
    for r in range(old_size):
        a, b = r * n // old_size, (r + 1) * n // old_size
        if a <= hi and b >= lo:
            block = read_piece(r)
            idx = [slice(None)] * len(shape)
            idx[axis] = slice(max(lo, a) - a, min(hi, b) - a)
            parts.append(block[tuple(idx)])
    return np.concatenate(parts, axis=axis)


BROKEN = {"atomic_save": [_in_place, _latest_first],
          "load_shard": [_read_everything, _same_rank, _inclusive_end]}

