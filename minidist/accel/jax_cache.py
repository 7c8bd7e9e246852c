"""minidist's own cache of compiled JAX executables: a program met in an earlier run loads untraced.

JAX's persistent cache is keyed by a hash of the *lowered* module, so even a hit traces the function
and lowers it to MLIR first, for every program, and a lesson meets hundreds. This cache keys a
program by what minidist knows before tracing -- which function, the arguments' shapes, dtypes and
devices, the values baked in, the versions and settings that change what JAX would emit -- and stores
the serialized executable (``jax.experimental.serialize_executable``) beside what the trace learned
(``aux``: an op's static attributes). A hit deserializes it and never traces.

A stale or colliding entry would be a silent wrong answer, so the key is conservative: what it
holds, and which units get none, is in jax_identity.py; the arguments' part is below. Files live in
``<cache>/exe`` (``MINIDIST_JAX_CACHE``, default ~/.cache/minidist/jax; ``0``: off), written whole
and ``os.replace``d, each with a SHA-256 of its contents and its full key, checked before anything
is deserialized; a file that fails either, or an executable that rejects its arguments, is compiled
again and overwritten. ``evict`` (jax_cache_files.py) keeps the folder under
``MINIDIST_JAX_CACHE_MB`` (default 2000), least recently used first. What a hit costs against a
compile, and how the key was tested: chapter 16 (lessons/16-tpu.md).
"""

from __future__ import annotations

import collections
import hashlib
import os
import pickle
import tempfile
import threading

import numpy as np

from minidist.accel.jax_cache_files import cache_dir, cache_root, evict, limit_bytes, stamp_unstamped  # noqa: F401
from minidist.accel.jax_compile import _compile_fresh
from minidist.accel.jax_identity import (  # noqa: F401 - the unit's name, importable here as before
    _SOURCES,
    _SOURCES_LOCK,
    PLAIN,
    _environment,
    identity,
    source_digest,
    value_id,
)

FORMAT = b"minidist-jax-exe-1\n"
STATS: collections.Counter = collections.Counter()  # compiled, loaded, stored, corrupt, rejected, ...
_STATS_LOCK = threading.Lock()


def _count(what: str) -> None:
    with _STATS_LOCK:  # (rank threads compile and load at once; a lost count would skew a test)
        STATS[what] += 1


class Untraceable(Exception):
    """This program's trace failed before for these arguments (the caller runs it eagerly)."""


# -- arguments ----------------------------------------------------------------------------------
class _Traced(Exception):
    """An argument is a tracer: the caller is itself being traced, so inline the plain ``jit``."""


_ARRAY: list = []  # [jax's array type, tree_flatten, trace_context], bound on first use (no JAX import here)


def _bind() -> list:
    if not _ARRAY:
        import jax
        from jax._src import config

        _ARRAY[:] = [type(jax.device_put(np.zeros(()))), jax.tree_util.tree_flatten, config.trace_context]
    return _ARRAY


def array_type() -> type:
    """JAX's concrete array type (bound on first use: importing this module does not import JAX)."""
    return (_ARRAY or _bind())[0]


def _flat_tree(n: int):
    """The tree of ``n`` arguments that are each one array (``Program.__call__``'s flat signature)."""
    return _ARRAY[1]((0,) * n)[1]


def _leaf_sig(x):
    """What a compiled program depends on in one argument (in memory: fast, not yet stable)."""
    t = type(x)
    if t is _ARRAY[0]:
        return (x.shape, x.dtype, x.weak_type, x.sharding, x.committed)
    if t.__module__.startswith(("jax", "jaxlib")):  # a tracer: the caller is being traced
        raise _Traced
    if t is np.ndarray:
        return ("np", x.shape, x.dtype)
    if isinstance(x, np.generic):
        return ("np", (), x.dtype)
    return (t,)  # a Python scalar: a weakly typed argument, its value not part of the program


def _stable_leaf(s) -> str | None:
    """``_leaf_sig`` as text that means the same in another process, or None (an array sharded over
    several devices: this cache keeps single-device programs only)."""
    if len(s) == 5:
        shape, dtype, weak, sharding, committed = s
        devices = getattr(sharding, "_device_assignment", None)
        if type(sharding).__name__ != "SingleDeviceSharding" or not devices or len(devices) != 1:
            return None
        d = devices[0]
        return repr((shape, str(dtype), weak, d.platform, d.id, sharding.memory_kind, committed))
    if len(s) == 3:
        return repr(("np", s[1], str(s[2])))
    return repr(("py", s[0].__name__))


# -- the program --------------------------------------------------------------------------------
class Program:
    """One compiled unit: ``fn`` under ``jax.jit``, compiled once per argument signature, loaded from
    the cache when an earlier run (or another process) compiled it.

    ``identity``: a tuple of text naming everything ``fn`` bakes in (None: never persist, compile
    each run). ``aux``: a dict ``fn`` fills while it is traced (what the trace learned); it is
    stored with the executable and restored on a hit, which does not trace. ``donate_argnums`` as
    ``jax.jit``'s (the loaded executable donates too). The first call of each signature holds a
    lock: rank threads meeting it at once compile (or load) it once."""

    def __init__(self, name: str, fn, identity: tuple | None, donate_argnums: tuple = (), aux=None):
        self.name, self.fn, self.identity, self.donate = name, fn, identity, tuple(donate_argnums)
        self.aux = aux
        self._exes: dict = {}     # signature -> [executable, loaded and not yet called?]
        self._failed: set = set()  # signatures whose trace raised
        self._locks: dict = {}
        self._lock = threading.Lock()
        self._jit = None

    def jitted(self):
        import jax

        if self._jit is None:
            self._jit = jax.jit(self.fn, donate_argnums=self.donate)
        return self._jit

    def __call__(self, *args):
        array, flatten, trace_context = _ARRAY or _bind()
        sigs = []
        for x in args:  # the common call, an op's arrays: no flattening, its tree is their number
            if type(x) is not array:
                break
            sigs.append((x.shape, x.dtype, x.weak_type, x.sharding, x.committed))  # = _leaf_sig(x)
        else:
            sig = (len(args), tuple(sigs), trace_context())
            entry = self._exes.get(sig)
            if entry is not None and not entry[1]:
                return entry[0](*args)
            return self._run(sig, args, entry)
        leaves, tree = flatten(args)
        try:
            sig = (tree, tuple([_leaf_sig(x) for x in leaves]), trace_context())
        except _Traced:
            return self.jitted()(*args)
        return self._run(sig, args, self._exes.get(sig))

    def _run(self, sig, args, entry):
        if entry is None:
            entry = self._first(sig, args)
        if not entry[1]:
            return entry[0](*args)
        try:
            out = entry[0](*args)
        except (TypeError, ValueError):  # a loaded executable that does not take these arguments
            _count("rejected")
            with self._lock:
                entry[:] = [self._compile(sig, args, self._key(sig)), False]
            return entry[0](*args)
        entry[1] = False  # it took arguments of this signature: the next call needs no check
        return out

    def _first(self, sig, args) -> list:
        if sig in self._failed:
            raise Untraceable(self.name)
        with self._lock:
            lock = self._locks.setdefault(sig, threading.Lock())
        with lock:
            entry = self._exes.get(sig)
            if entry is not None:
                return entry
            if sig in self._failed:
                raise Untraceable(self.name)
            _count(f"programs:{self.name}")
            key = self._key(sig)
            exe = self._load(key) if key else None
            entry = [exe, True] if exe is not None else None
            if entry is None:
                try:
                    entry = [self._compile(sig, args, key), False]
                except Exception:
                    self._failed.add(sig)
                    raise
            self._exes[sig] = entry
            return entry

    def _key(self, sig) -> str | None:
        """The text naming this program in any process, or None: not persistable, or the cache off."""
        if self.identity is None or cache_dir() is None:
            return None
        tree, leaves, _ = sig
        stable = [_stable_leaf(s) for s in leaves]
        text = str(_flat_tree(tree) if isinstance(tree, int) else tree)  # (n: n arrays, a flat tuple)
        if None in stable or "CustomNode" in text:
            return None
        return repr((FORMAT, self.name, self.identity, self.donate, text, stable, _environment()))

    def _path(self, key: str) -> str:
        return os.path.join(cache_dir(), hashlib.sha256(key.encode()).hexdigest() + ".exe")

    def _load(self, key: str):
        """The executable stored under ``key`` (``aux`` restored), or None: absent or unusable."""
        import jax
        from jax.experimental.serialize_executable import deserialize_and_load

        path = self._path(key)
        try:
            with open(path, "rb") as fh:
                if os.fstat(fh.fileno()).st_uid != os.getuid():  # planted by someone else: never run it
                    _count("corrupt")
                    return None
                blob = fh.read()
            os.utime(path)  # used now: ``evict`` removes the least recently used first
        except OSError:
            return None
        try:
            n = len(FORMAT)
            head, digest, body = blob[:n], blob[n:n + 32], blob[n + 32:]
            if head != FORMAT or hashlib.sha256(body).digest() != digest:
                raise ValueError("checksum")
            entry = pickle.loads(body)
            if entry["key"] != key:
                raise ValueError("key")
            by_id = {d.id: d for d in jax.devices()}
            exe = deserialize_and_load(*entry["exe"], execution_devices=[by_id[i] for i in entry["devices"]])
        except Exception:  # truncated, corrupted, another format: compile again and overwrite
            _count("corrupt")
            return None
        if self.aux is not None:
            self.aux.update(entry["aux"])  # (no clear(): another rank may be reading it)
        _count("loaded")
        return exe

    def _compile(self, sig, args, key):
        compiled, fresh = _compile_fresh(self.jitted().lower(*args))
        _count("compiled")
        if key is not None and fresh:
            self._store(key, compiled)
        else:
            _count("unpersisted")
        return compiled

    def _store(self, key: str, compiled) -> None:
        from jax.experimental.serialize_executable import serialize

        aux = dict(self.aux) if self.aux is not None else None
        if aux is not None and value_id(aux) is None:  # what the trace learned is not plain data
            _count("unpersisted")
            return
        try:
            devices = [d.id for d in compiled.runtime_executable().local_devices()]
            body = pickle.dumps({"key": key, "exe": serialize(compiled), "aux": aux, "devices": devices})
        except Exception:  # an executable this backend cannot serialize
            _count("unpersisted")
            return
        path = self._path(key)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(FORMAT + hashlib.sha256(body).digest() + body)
                os.replace(tmp, path)  # atomic: a reader sees the old file or the new, never half
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError:  # a read-only or full disk: the run goes on, uncached
            _count("store_failed")
            return
        _count("stored")
        if STATS["stored"] % 200 == 1:  # the first store of a process, then every 200th
            evict()


__all__ = ["PLAIN", "Program", "STATS", "Untraceable", "cache_dir", "cache_root", "stamp_unstamped", "evict",
           "identity", "source_digest", "value_id"]
