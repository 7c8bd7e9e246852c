"""Naming a compiled unit safely: the part of minidist's executable-cache key that says what runs.

A stale or colliding entry would be a silent wrong answer, so the name is conservative: a unit
whose identity cannot be written down safely (a closure over an object with no faithful ``repr``, a
function without a source file) gets None, and is compiled every run, never stored. The key holds:

* the unit: module and qualified name of the op class or function, a digest of its code objects
  (constants and nested functions too), its defaults and closure values by ``repr``;
* every argument's pytree place, shape, dtype, weak type, device and committed-ness;
* the values baked in (``identity``: shapes of the op's inputs, keyword values, ...);
* JAX, jaxlib and NumPy versions, JAX's trace-time settings (x64, default matmul precision, ...),
  the platform and its version, the device kinds and count, ``XLA_FLAGS``;
* a digest of every ``.py`` file of the minidist package, computed once per process: any edit to
  minidist invalidates everything. A function outside minidist adds its own file's digest and the
  globals it reads (constants by value, helpers by identity, user modules by file digest).
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import types

import numpy as np

PLAIN = (type(None), bool, int, float, complex, str, bytes, slice, type(Ellipsis), np.dtype, np.generic)
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
