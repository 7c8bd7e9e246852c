"""minidist's own cache of compiled JAX executables: a program met in an earlier run loads untraced.

JAX's persistent cache is keyed by a hash of the *lowered* module, so even a hit traces the
function and lowers it to MLIR before it can look, for every program, and a lesson meets hundreds
(chapter 16 has what each step costs). This cache keys a program by what minidist knows before
tracing -- which function, the arguments' shapes and dtypes and devices, the values baked in, the versions and
settings that change what JAX would emit -- and stores the serialized executable
(``jax.experimental.serialize_executable``) beside whatever the trace learned (``aux``: an op's
static attributes). A hit deserializes it and never traces.

A stale or colliding entry would be a silent wrong answer, so the key is conservative, and a unit
whose identity cannot be written down safely (a closure over an object with no faithful ``repr``, a
function without a source file) is compiled every run, never stored. The key holds:

* the unit: module and qualified name of the op class or function, a digest of its code objects
  (constants and nested functions too), its defaults and closure values by ``repr``;
* every argument's pytree place, shape, dtype, weak type, device and committed-ness;
* the values baked in (``identity``: shapes of the op's inputs, keyword values, ...);
* JAX, jaxlib and NumPy versions, JAX's trace-time settings (x64, default matmul precision, ...),
  the platform and its version, the device kinds and count, ``XLA_FLAGS``;
* a digest of every ``.py`` file of the minidist package, computed once per process: any edit to
  minidist invalidates everything. A function outside minidist adds its own file's digest and the
  globals it reads (constants by value, helpers by identity, user modules by file digest).

Files live in ``<cache>/exe`` (``MINIDIST_JAX_CACHE``, default ~/.cache/minidist/jax; ``0`` turns
this cache off: nothing is read or written). Each is written to a temporary file and
``os.replace``d, so ranks of several processes sharing the directory never see half a file; each
carries a SHA-256 of its contents and its full key, checked before anything is deserialized. A
file that fails either check, or an executable that rejects its arguments, is compiled again and
overwritten. The folder is kept under ``MINIDIST_JAX_CACHE_MB`` (default 2000) by ``evict``, least
recently used first: every edit of minidist makes all keys new.
"""

from __future__ import annotations

import collections
import hashlib
import os
import pickle
import sys
import tempfile
import threading
import types
import warnings

import numpy as np

FORMAT = b"minidist-jax-exe-1\n"
PLAIN = (type(None), bool, int, float, complex, str, bytes, slice, type(Ellipsis), np.dtype, np.generic)
STATS: collections.Counter = collections.Counter()  # compiled, loaded, stored, corrupt, rejected, ...
_STATS_LOCK = threading.Lock()


def _count(what: str) -> None:
    with _STATS_LOCK:  # (rank threads compile and load at once; a lost count would skew a test)
        STATS[what] += 1


class Untraceable(Exception):
    """This program's trace failed before for these arguments (the caller runs it eagerly)."""


def cache_root() -> str | None:
    """``MINIDIST_JAX_CACHE`` (default ~/.cache/minidist/jax), or None when it is ``0``: off."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "minidist", "jax")
    root = os.environ.get("MINIDIST_JAX_CACHE", default)
    return None if root in ("0", "") else root


def cache_dir() -> str | None:
    """Where executables are kept (``<MINIDIST_JAX_CACHE>/exe``), or None when the cache is off."""
    root = cache_root()
    return None if root is None else os.path.join(root, "exe")


# -- naming a unit safely ---------------------------------------------------------------------
_SOURCES: dict = {}
_SOURCES_LOCK = threading.Lock()


def source_digest() -> str:
    """SHA-256 of every ``.py`` file of the minidist package (paths and contents), once per process."""
    with _SOURCES_LOCK:
        if "minidist" not in _SOURCES:
            root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the minidist package
            h = hashlib.sha256()
            for d, dirs, files in os.walk(root):
                dirs[:] = sorted(x for x in dirs if x != "__pycache__")
                for f in sorted(x for x in files if x.endswith(".py")):
                    path = os.path.join(d, f)
                    h.update(os.path.relpath(path, root).encode() + b"\0")
                    with open(path, "rb") as fh:
                        h.update(hashlib.sha256(fh.read()).digest())
            _SOURCES["minidist"] = h.hexdigest()
        return _SOURCES["minidist"]


def _module_digest(name: str) -> str | None:
    """The digest that covers module ``name``'s code: minidist's package digest, or the module's own
    file's. None (do not persist) for a module with no source file (an interactive session)."""
    if name == "minidist" or name.startswith("minidist."):
        return source_digest()
    path = getattr(sys.modules.get(name), "__file__", None)
    if not path or not path.endswith(".py"):
        return None
    with _SOURCES_LOCK:
        if path not in _SOURCES:
            try:
                with open(path, "rb") as fh:
                    _SOURCES[path] = hashlib.sha256(fh.read()).hexdigest()
            except OSError:
                _SOURCES[path] = None
        return _SOURCES[path]


def _code_digest(code: types.CodeType) -> str:
    """A digest of a code object: bytecode, names, argument counts, flags, and constants -- nested
    code objects (inner functions, lambdas) by their own digest, frozensets sorted (their order
    depends on the process's string hashing)."""
    def const(c):
        if isinstance(c, types.CodeType):
            return "code:" + _code_digest(c)
        if isinstance(c, frozenset):
            return "frozenset:" + repr(sorted(map(const, c)))
        if isinstance(c, tuple):
            return "tuple:" + repr([const(x) for x in c])
        return repr(c)

    parts = (code.co_code, code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars,
             code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags,
             [const(c) for c in code.co_consts])
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def value_id(v, _seen=None):
    """A faithful, process-independent text for ``v``, or None when there is none: plain values
    (numbers, strings, slices, dtypes, tuples and lists of them) by ``repr``, functions and classes
    by ``identity``, modules by name. Anything else (an object whose ``repr`` hides its state, or
    shows its address) makes the unit that holds it unpersistable."""
    if isinstance(v, (tuple, list)):
        parts = [value_id(x, _seen) for x in v]
        return None if None in parts else f"{type(v).__name__}({', '.join(parts)})"
    if isinstance(v, dict):
        parts = [(value_id(k, _seen), value_id(x, _seen)) for k, x in v.items()]
        return None if any(None in p for p in parts) else "dict(" + repr(sorted(parts)) + ")"
    if isinstance(v, PLAIN):
        return repr(v)
    if isinstance(v, types.ModuleType):
        return f"module:{v.__name__}"
    if isinstance(v, type) and v.__module__ in ("builtins", "numpy"):
        return repr(v)
    if isinstance(v, (types.FunctionType, type)):
        ident = identity(v, _seen)
        return None if ident is None else repr(ident)
    return None


def _names(code: types.CodeType) -> set:
    """The global (and attribute) names a code object and its nested functions use."""
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _names(c)
    return names


def _installed(module: types.ModuleType) -> bool:
    """Part of Python or an installed package (named by the versions in the key), not user code."""
    path = getattr(module, "__file__", None) or ""
    return not path or "-packages" in path or path.startswith(sys.base_prefix)


def _globals_id(fn, _seen) -> str | None:
    """What a function outside minidist reads from its module's globals -- plain values by repr
    (a constant rebound at run time), functions and classes by ``identity``, user modules by name
    and file digest (a helper edited in another file) -- or None if one of them has no name.
    (minidist's own functions are covered by the package digest.)"""
    out = []
    for name in sorted(_names(fn.__code__)):
        if name not in fn.__globals__:
            continue  # a builtin, or only an attribute's name
        v = fn.__globals__[name]
        if isinstance(v, types.ModuleType):
            if v.__name__ == "minidist" or v.__name__.startswith("minidist.") or _installed(v):
                out.append((name, v.__name__))
                continue
            vid = _module_digest(v.__name__)
        else:  # an array, a dict, any object: named faithfully (value_id) or the unit is not stored,
            vid = value_id(v, _seen)  # since a program bakes in what it reads (a global W = 5 read as 1)
        if vid is None:
            return None
        out.append((name, vid))
    return repr(out)


def identity(obj, _seen=None) -> tuple | None:
    """The stable name of a function or class, as a tuple of strings, or None if it has none.

    A function: module, qualified name, code digest, defaults and closure values (``value_id``; a
    closure over a function names that function too), its module's digest, and -- outside
    minidist -- the globals it reads (``_globals_id``). A class: the same for
    each class it inherits from (module, name, each method's code) -- an op is its ``forward`` and
    ``backward``. Recursion (a function that closes over itself) is cut by ``_seen``."""
    _seen = set() if _seen is None else _seen
    if id(obj) in _seen:
        return ("recursive", getattr(obj, "__qualname__", "?"))
    _seen = _seen | {id(obj)}
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, types.FunctionType):
        src = _module_digest(obj.__module__)
        if src is None:
            return None
        cells = []
        for cell in obj.__closure__ or ():
            try:
                cells.append(value_id(cell.cell_contents, _seen))
            except ValueError:  # an empty cell (a name assigned after the function was made)
                cells.append("<empty>")
        kw = sorted((obj.__kwdefaults__ or {}).items())
        defaults = [value_id(d, _seen) for d in obj.__defaults__ or ()] + [value_id(kv, _seen) for kv in kw]
        ours = obj.__module__ == "minidist" or obj.__module__.startswith("minidist.")
        glob = "" if ours else _globals_id(obj, _seen)
        if None in cells or None in defaults or glob is None:
            return None
        return ("function", obj.__module__, obj.__qualname__, _code_digest(obj.__code__),
                repr(defaults), repr(cells), glob, src)
    if isinstance(obj, type):
        parts = []
        for k in obj.__mro__:
            if k is object:
                continue
            src = _module_digest(k.__module__)
            if src is None:
                return None
            methods = sorted((n, identity(f, _seen)) for n, f in vars(k).items()
                             if isinstance(f, (types.FunctionType, staticmethod, classmethod)))
            if any(m is None for _, m in methods):
                return None
            parts.append((k.__module__, k.__qualname__, repr(methods), src))
        return ("class", repr(parts))
    return None


def _environment() -> tuple:
    """What changes the program JAX emits besides the function and its arguments: versions, JAX's
    trace-time settings (``config.trace_context``: x64, matmul precision, default device, ...; an
    entry whose repr shows an address is named by its type), platform, devices, ``XLA_FLAGS``."""
    import jax
    import jaxlib
    from jax._src import config

    ctx = []
    for x in config.trace_context():
        r = repr(x)
        ctx.append(type(x).__qualname__ if " at 0x" in r else r)
    dev = jax.devices()
    return (jax.__version__, jaxlib.__version__, np.__version__, tuple(ctx), dev[0].platform,
            dev[0].client.platform_version, tuple(sorted({d.device_kind for d in dev})), len(dev),
            os.environ.get("XLA_FLAGS", ""), source_digest())


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


# -- compiling, not loading from JAX's cache ------------------------------------------------------
# An executable that JAX loaded from its own persistent cache serializes WITHOUT its machine code
# (measured, jax 0.10.2 on CPU: the file loads, and running it fails with "Function
# broadcast_add_fusion not found"). So our programs are compiled under a JAX cache key of their own
# (the module's source locations included) that JAX never writes (minimum compile time infinite),
# both set for this thread only -- JAX's cache keeps serving the eager programs outside minidist's
# units. A hit on JAX's cache that happens anyway is seen (its event, in this thread) and the
# program is used but not stored.
_HITS = threading.local()
_LISTENING: list = []


_WARNED: set = set()


def _warn_once(text: str) -> None:
    with _STATS_LOCK:
        if text in _WARNED:
            return
        _WARNED.add(text)
    warnings.warn(text, RuntimeWarning, stacklevel=3)


def _version(module: str) -> str:
    return getattr(sys.modules.get(module), "__version__", "?")


def _count_hit(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _HITS.n = getattr(_HITS, "n", 0) + 1


_PRIVATE_SETTINGS = ("compilation_cache_include_metadata_in_key", "persistent_cache_min_compile_time_secs")


def _compile_fresh(lowered):
    """(compiled, fresh): ``lowered.compile()``, fresh when XLA compiled it (not JAX's cache).

    An executable JAX's own cache handed back serializes without its code, so only fresh ones may
    be stored. Telling them apart needs two of JAX's private settings; a JAX without them still
    compiles every program (none is called fresh, so none is stored), with one warning that says
    so -- not a silent fall back to eager dispatch, ~45x slower."""
    from jax import monitoring

    try:
        from jax._src import config

        settings = [getattr(config, name) for name in _PRIVATE_SETTINGS]
    except (ImportError, AttributeError) as e:
        _warn_once(f"minidist stores no JAX executables: this JAX ({_version('jax')}) lacks a setting "
                   f"its cache needs ({e}); programs are compiled each run")
        return lowered.compile(), False
    with _SOURCES_LOCK:
        if not _LISTENING:
            _LISTENING.append(True)
            monitoring.register_event_listener(_count_hit)
    before = getattr(_HITS, "n", 0)
    with settings[0](True), settings[1](float("inf")):
        compiled = lowered.compile()
    return compiled, getattr(_HITS, "n", 0) == before


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


def limit_bytes() -> float:
    """``MINIDIST_JAX_CACHE_MB`` (default 2000) in bytes: the cap of ``exe/``, and of JAX's own files."""
    return 1e6 * float(os.environ.get("MINIDIST_JAX_CACHE_MB", "2000"))


def evict(limit_mb: float | None = None) -> int:
    """Keep the cache folder under ``limit_mb`` (``MINIDIST_JAX_CACHE_MB``, default 2000): remove
    the least recently used executables (a load touches its file) down to 80% of it, and temporary
    files a killed writer left over an hour ago. Any edit of minidist makes every key new, so
    without this a developer's cache would only grow. Returns how many files were removed."""
    import time

    folder = cache_dir()
    if folder is None or not os.path.isdir(folder):
        return 0
    limit = limit_bytes() if limit_mb is None else 1e6 * limit_mb
    entries, removed, now = [], 0, time.time()
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        try:
            st = os.stat(path)
            if name.startswith(".tmp-") and now - st.st_mtime > 3600:
                os.unlink(path)
                removed += 1
            elif name.endswith(".exe"):
                entries.append((st.st_mtime, st.st_size, path))
        except OSError:  # removed by another process meanwhile
            continue
    total = sum(size for _, size, _ in entries)
    if total <= limit:
        return removed
    for _, size, path in sorted(entries):  # oldest use first
        if total <= 0.8 * limit:
            break
        try:
            os.unlink(path)
            removed += 1
        except OSError:
            pass
        total -= size
    return removed


def stamp_unstamped(root: str) -> int:
    """Give JAX's own cache entries in ``root`` that have no access-time stamp one (the time the
    entry was written); returns how many.

    JAX's persistent cache writes ``<key>-cache`` and, only when its size is capped, a
    ``<key>-atime`` stamp (8 bytes, little-endian nanoseconds). Once capped (``persistent_cache``
    caps it), every write first looks for the least recently used entry and reads each stamp. One
    entry with no stamp -- written before the cap, or by a process killed between its two files --
    made every write fail ("Error writing persistent compilation cache entry ... -atime", a warning
    in the lesson's output), so nothing new was kept and nothing was evicted. Stamping, not
    deleting: the entries stay usable, whoever wrote them. JAX's lock on the folder is held meanwhile
    (a write of JAX's own is two files); a folder it cannot lock or write is left as is."""
    import filelock  # JAX's capped cache needs it too: persistent_cache calls this only when it's there

    try:
        names = set(os.listdir(root))
        lock = filelock.FileLock(os.path.join(root, ".lockfile"), timeout=10)  # JAX's own lock file
        lock.acquire()
    except (OSError, filelock.Timeout):
        return 0
    try:
        return _stamp(root, names)
    finally:
        lock.release()


def _stamp(root: str, names: set) -> int:
    stamped = 0
    for name in names:
        if name.endswith("-cache") and name[:-len("-cache")] + "-atime" not in names:
            try:
                written = os.stat(os.path.join(root, name)).st_mtime_ns
                with open(os.path.join(root, name[:-len("-cache")] + "-atime"), "wb") as fh:
                    fh.write(written.to_bytes(8, "little"))
                stamped += 1
            except OSError:  # removed meanwhile, or a read-only folder
                pass
    return stamped


__all__ = ["PLAIN", "Program", "STATS", "Untraceable", "cache_dir", "cache_root", "stamp_unstamped", "evict",
           "identity", "source_digest", "value_id"]
