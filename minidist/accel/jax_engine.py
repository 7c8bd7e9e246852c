"""The JAX engine: which compiled programs minidist runs on JAX, and how few.

On JAX every array operation is a compiled XLA program, so a lesson's time on JAX is mostly the
number of distinct programs it needs. The engine makes them few and large:

* **Ops**: ``kernel(cls)`` (jax_ops.py) returns a subclass of the op whose ``forward`` and
  ``backward`` each run as one compiled call, keyed by the arguments' shapes, dtypes and plain
  values (jax_values.py); an op that cannot be traced runs eagerly. ``Function.apply`` asks, off NumPy.
* **Optimizer steps**: ``fused`` runs one parameter's update formula over every parameter as ONE
  compiled call, the step's scalars as arguments (a schedule never recompiles), state donated.
* **Array functions** outside the ops (DDP's buckets, one ring-attention step): ``pure_call``.
* ``install`` registers all three with the compilation seam (``compiled.py``) that algorithms call.
* Each unit is a ``jax_cache.Program``: compiled once per argument signature, not once per rank,
  and stored on disk under a key computed before tracing, so a later run loads it untraced.
  ``compilations()`` counts the programs; ``persistent_cache`` keeps JAX's own cache for the rest.

``MINIDIST_JAX_JIT=0`` turns it off (eager dispatch, the reference). Why fewer programs, what each
costs and what was measured: chapter 16 (lessons/16-tpu.md, "A faster eager engine on JAX").
"""

from __future__ import annotations

import collections
import os

import numpy as np

from minidist.accel import compiled, jax_cache
from minidist.accel.jax_ops import _LOCKS_LOCK, PURE_OPS, kernel  # noqa: F401 - kernel, PURE_OPS: importable here
from minidist.accel.jax_values import _is_array, _is_jax, _value_key

STATS: collections.Counter = collections.Counter()  # "calls:<unit>" (fused)


def enabled() -> bool:
    return os.environ.get("MINIDIST_JAX_JIT", "1") not in ("0", "false", "False", "")


_FUSED: dict = {}


def fused(name: str, formula, columns: list, scalars: tuple, donate: tuple = ()) -> list:
    """``[formula(*row, *scalars) for row in zip(*columns)]`` as ONE compiled call.

    An optimizer step on JAX: ``columns`` are lists with one array per parameter (parameters,
    gradients, each state); ``formula`` maps one parameter's arrays to its new ones. Eager, that
    is ~8 dispatches per parameter and one small compiled program per parameter shape; here it is
    one program for the whole model, compiled once. ``scalars`` (learning rate, bias corrections)
    are traced arguments, not constants, so a schedule that changes the learning rate every step
    reuses the program. ``donate``: the indices of columns whose buffers the result may reuse
    (the optimizer's own state; never the parameters, which the graph or a caller may still hold).
    """
    fn = _FUSED.get((formula, donate))
    if fn is None:
        def over_all(*cols_and_scalars):
            *cols, sc = cols_and_scalars
            return [formula(*row, *sc) for row in zip(*cols)]

        op = jax_cache.identity(formula)
        fn = _FUSED.setdefault((formula, donate), jax_cache.Program(
            name, over_all, None if op is None else ("fused", op), donate_argnums=donate))
    STATS[f"calls:{name}"] += 1
    return fn(*columns, tuple(float(x) for x in scalars))


def _holds_jax(v) -> bool:
    """A JAX array, or lists and tuples holding one at any depth (ring attention's chunk lists)."""
    return _is_jax(v) or isinstance(v, (list, tuple)) and any(map(_holds_jax, v))


def pure_call(fn, made: dict, args, kwargs):
    """``compiled.pure``'s call on the engine: on JAX arrays ``fn`` -- a pure function of arrays (in
    lists and tuples too) and plain values -- as one compiled call per signature (kept in ``made``),
    the plain values baked in; on anything else (NumPy, CuPy, the engine off), ``fn`` as written.
    For the array code outside the ops that would otherwise compile one program per primitive and
    shape (a bucket's views: a slice and a reshape per parameter, each a program of its own on eager JAX)."""
    if not any(map(_holds_jax, (*args, *kwargs.values()))) or not enabled():
        return fn(*args, **kwargs)  # NumPy, CuPy, the engine off
    import jax

    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        return fn(*args, **kwargs)  # called while a compiled op is traced: part of that program
    at = tuple(i for i, x in enumerate(leaves) if _is_array(x))
    fixed = tuple(None if i in at else x for i, x in enumerate(leaves))
    key = (tree, tuple(map(_value_key, fixed)), at)  # typed: x * 2 and x * 2.0 are two programs
    try:
        prog = made.get(key)
    except TypeError:  # a value that cannot be part of a key (not plain): as written
        return fn(*args, **kwargs)
    if prog is None:
        def run(*dyn):
            full = list(fixed)
            for i, d in zip(at, dyn):
                full[i] = d
            a, kw = jax.tree_util.tree_unflatten(tree, full)
            return fn(*a, **kw)

        op, baked = jax_cache.identity(fn), jax_cache.value_id(list(fixed))
        ident = None if op is None or baked is None else ("pure", op, str(tree), baked, repr(at))
        prog = made.setdefault(key, jax_cache.Program(f"pure:{fn.__qualname__}", run, ident))
    try:
        return prog(*(leaves[i] for i in at))
    except Exception:  # cannot be traced (a boolean mask index): as written, for this signature
        return fn(*args, **kwargs)


def compiles(array) -> bool:
    """Does an optimizer update ``array`` through ``fused``? (A JAX array, the engine on.)"""
    return enabled() and _is_jax(array)


def put_like(host, like):
    """Host array ``host`` moved where JAX array ``like`` lives: no compiled program. Committed to
    that device only if ``like`` is: a compiled call's program depends on which of its arguments
    are committed, and a mismatch would compile the optimizer's update twice."""
    import jax

    return jax.device_put(host, like.sharding) if like.committed else jax.device_put(host)


def zeros_like(a):
    """Zeros shaped like JAX array ``a`` on its device, made on the host (``put_like``)."""
    return put_like(np.zeros(a.shape, a.dtype), a)


def persistent_cache() -> None:
    """Keep the eager programs outside minidist's units (a lesson's own ``a + b`` on JAX arrays, an
    op that communicates and so runs eagerly) in JAX's persistent compilation cache (``MINIDIST_JAX_CACHE``,
    default ~/.cache/minidist/jax; ``0`` turns it off; a ``JAX_COMPILATION_CACHE_DIR`` of your own
    wins). The units themselves load from ``jax_cache`` (its ``exe`` folder), which skips the trace
    and lowering JAX's cache pays on every hit; the eager programs are the bulk of a warm lesson's
    compile time without it."""
    import jax

    path = jax_cache.cache_root()
    if path is None or os.environ.get("JAX_COMPILATION_CACHE_DIR") or \
            jax.config.jax_compilation_cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # JAX's files are capped too (its own LRU), by the same MINIDIST_JAX_CACHE_MB as minidist's exe/;
    # an entry of its with no stamp fails every write under the cap: stamped here. A capped cache
    # locks its folder with filelock (the jax extra installs it); without it JAX refuses every read
    # and write of the cache, so it stays uncapped then.
    try:
        import filelock  # noqa: F401
    except ImportError:
        return
    jax_cache.stamp_unstamped(path)
    jax.config.update("jax_compilation_cache_max_size", int(jax_cache.limit_bytes()))


_COMPILED = [0]
_LISTENING: list = []
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def compilations(kind: str | None = None) -> int:
    """How many XLA programs this process has compiled or loaded since the JAX backend started
    (every one: the engine's, the optimizers', eager JAX's per-primitive ones). ``kind="compiled"``:
    those XLA compiled (or JAX loaded from its own persistent cache, after tracing and lowering);
    ``kind="loaded"``: those loaded from minidist's executable cache (``jax_cache``: no trace).
    Tests count what a step adds; profile a lesson with it."""
    if kind not in (None, "compiled", "loaded"):
        raise ValueError(f"compilations(kind={kind!r}): kind is None, 'compiled' or 'loaded'")
    compiled, loaded = _COMPILED[0], jax_cache.STATS["loaded"]
    return compiled if kind == "compiled" else loaded if kind == "loaded" else compiled + loaded


def _count_compile(event: str, seconds: float, **kwargs) -> None:
    if event == _COMPILE_EVENT:
        with _LOCKS_LOCK:  # ranks compile in several threads
            _COMPILED[0] += 1


def install() -> None:
    """Route ops on JAX arrays through ``kernel`` (``tensor.Function.apply``'s hook), and count
    compilations (``compilations``)."""
    from jax import monitoring

    with _LOCKS_LOCK:
        if not _LISTENING:
            _LISTENING.append(True)
            monitoring.register_event_duration_secs_listener(_count_compile)

    compiled.register(Engine if enabled() else Uncompiled)


class Engine:
    """What ``install`` registers with the compilation seam (``compiled.py``)."""

    pure_call, fused, compiles = staticmethod(pure_call), staticmethod(fused), staticmethod(compiles)
    kernel, zeros_like = staticmethod(kernel), staticmethod(zeros_like)


class Uncompiled:
    """The engine under ``MINIDIST_JAX_JIT=0``: every op and function eager, as written."""

    pure_call = staticmethod(lambda fn, made, args, kwargs: fn(*args, **kwargs))
    compiles = staticmethod(lambda array: False)
    kernel = staticmethod(lambda cls: cls)
    zeros_like = staticmethod(zeros_like)


__all__ = ["STATS", "Engine", "Uncompiled", "compilations", "compiles", "enabled", "fused", "install",
           "kernel", "pure_call", "zeros_like"]
