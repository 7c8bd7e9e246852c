"""The JAX engine: which compiled programs minidist runs on JAX, and how few.

On JAX every array operation is a compiled XLA program -- eager ``x * y`` on a new shape compiles a
one-multiply program first -- and a lesson's time on JAX is mostly the number of distinct programs
it needs (compiled by XLA; or loaded from JAX's persistent cache, which traces and lowers it
first; or, cheapest, from minidist's own cache, ``jax_cache``, which does neither). So:

* **Ops**: ``kernel(cls)`` returns a subclass of the op whose ``forward`` runs ``cls.forward`` under
  ``jax.jit`` with a stand-in context, returning the output, what it saved for backward, and the
  array attributes it set; plain attributes (shapes, axes) are remembered from the trace. Its
  ``backward`` runs ``cls.backward`` the same way. Keys: the op, each argument's shape and dtype
  (non-arrays by value; an array passed by keyword, like an index, is an argument too), the keyword
  arguments, which inputs want gradients. An op that cannot be traced (a host random generator, a
  value read back with ``int()``) runs eagerly, decided once per key; its backward still compiles.
  ``tensor.Function.apply`` asks ``kernel`` only for non-NumPy arrays.
* **Optimizer steps**: ``fused`` runs one parameter's update formula over every parameter as ONE
  compiled call, the step's scalars as arguments (a schedule never recompiles), state donated.
* **Array functions** outside the ops (DDP's buckets, one ring-attention step): ``pure``.
* Each of these units is a ``jax_cache.Program``: compiled once per argument signature, not once
  per rank (JAX does not merge concurrent compiles), and stored on disk under a key minidist
  computes before tracing, so a later run loads the executable without tracing or lowering.
* ``compilations()`` counts every program compiled or loaded; ``persistent_cache`` keeps JAX's own
  cache for the eager programs outside these units.

``MINIDIST_JAX_JIT=0`` turns it off (eager dispatch, the reference).
"""

from __future__ import annotations

import collections
import os
import sys
import threading

import numpy as np

from minidist.accel import jax_cache

_FORWARD: dict = {}   # key -> (jitted forward, static attributes holder) or None (runs eagerly)
_KERNELS: dict = {}   # op class -> its jitted subclass
_RESERVED = ("needs_grad", "record", "_saved", "_unpack")

# Every compiled unit below is a ``jax_cache.Program``: compiled once per argument signature (the
# first call holds a lock, so rank threads meeting a new shape at once compile it once: JAX does not
# merge concurrent compilations), and loaded from minidist's executable cache when a run before
# compiled it -- no trace, no lowering.
_LOCKS: dict = {}
_LOCKS_LOCK = threading.Lock()
STATS: collections.Counter = collections.Counter()  # "calls:<unit>" (fused)


def enabled() -> bool:
    return os.environ.get("MINIDIST_JAX_JIT", "1") not in ("0", "false", "False", "")


class _TraceCtx:
    """The context an op sees while it is traced: saves and attributes, nothing else."""

    def __init__(self, needs_grad, record=True):
        self.needs_grad, self.record, self._saved = needs_grad, record, ()

    def save(self, *arrays):
        if self.record:  # (no graph: the compiled forward returns nothing for a backward)
            self._saved = arrays

    @property
    def saved(self):
        return self._saved


def _is_array(v) -> bool:
    """An array of any library (a module like ``jax.numpy`` has ``shape`` and ``dtype`` too)."""
    return isinstance(getattr(v, "shape", None), tuple) and hasattr(v, "dtype")


def _is_jax(v) -> bool:
    """A JAX array (checked by its type's module: no import of JAX)."""
    return type(v).__module__.startswith(("jax", "jaxlib"))


def _has_traced(v) -> bool:
    return _is_traced(v) or isinstance(v, (tuple, list)) and any(_has_traced(x) for x in v)


def _is_traced(v) -> bool:
    import jax

    return isinstance(v, (jax.Array, jax.core.Tracer))


_PLAIN = jax_cache.PLAIN


def _plain(v) -> bool:
    """A value the compiled op may bake in: numbers, strings, slices, dtypes (``np.float32`` the
    class too: ``ops.cast(x, np.float32)`` ran eagerly), tuples of them. Anything else (a random
    generator: its draws would be frozen at trace time) keeps the op eager."""
    if isinstance(v, (tuple, list)):
        return all(_plain(x) for x in v)
    return isinstance(v, _PLAIN) or isinstance(v, type) and issubclass(v, np.generic)


def _arg_key(a):
    """One argument as part of a key: an array by ``(shape, dtype)`` (the dtype object, not its
    str(), which costs more than the rest of the key), a plain value by ``_value_key``. The first
    item tells the two kinds apart: a shape is a tuple, a value's first item its type's name."""
    if _is_array(a):
        return (tuple(a.shape), a.dtype)
    if not _plain(a):
        raise TypeError("not a plain value")
    return _value_key(a)


def _value_key(v):
    """A plain value as part of a key: ``(type name, value)``. The type, since ``2 == 2.0 == True``
    hash alike, and an int array times 2.0 is float where times 2 stays int (one compiled program
    for both gave int). A slice (``x[1:3]``, ``split``) is spelled out: it is not hashable before
    Python 3.12, and an unhashable key would send the op to eager JAX, several programs per shape."""
    if isinstance(v, slice):
        return ("slice", _value_key(v.start), _value_key(v.stop), _value_key(v.step))
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, *map(_value_key, v))
    return (type(v).__name__, v)


def _split_kwargs(kwargs):
    """(plain keyword arguments, layout, inputs): a keyword argument that is an array, or a tuple
    holding arrays (an index like ``(rows, cols)``), becomes inputs -- one per array or element;
    ``layout`` names them, for ``_join_kwargs``."""
    plain, layout, extra = {}, [], []
    for k in sorted(kwargs):
        v = kwargs[k]
        if _is_array(v):
            layout.append((k, None))
            extra.append(v)
        elif isinstance(v, tuple) and any(_is_array(x) for x in v):
            layout.append((k, len(v)))
            extra.extend(v)
        else:
            plain[k] = v
    return plain, tuple(layout), extra


def _join_kwargs(plain, layout, extra) -> dict:
    """The keyword arguments again, from ``_split_kwargs``' parts (``extra`` possibly traced)."""
    kw, i = dict(plain), 0
    for k, n in layout:
        kw[k], i = (extra[i], i + 1) if n is None else (tuple(extra[i:i + n]), i + n)
    return kw


def _lock_for(name) -> threading.Lock:
    with _LOCKS_LOCK:
        return _LOCKS.setdefault(name, threading.Lock())


def _make_forward(cls, ctx, inputs, n_positional, kwargs, named, dyn_at, key):
    """(compiled forward, holder): the forward traced with the arrays ``dyn_at`` of ``inputs`` (the
    positional arguments, then the keyword arguments ``named``) as its arguments, everything else
    baked in; the holder learns at trace time what is static and what is saved (and is stored with
    the executable: a run that loads it does not trace). ``key`` names what is baked in."""
    holder: dict = {}
    fixed = [None if i in dyn_at else a for i, a in enumerate(inputs)]  # no array kept alive
    needs_grad, record = ctx.needs_grad, ctx.record

    def fwd(*dyn):
        args = list(fixed)
        for i, d in zip(dyn_at, dyn):
            args[i] = d
        c = _TraceCtx(needs_grad, record)
        out = cls.forward(c, *args[:n_positional], **_join_kwargs(kwargs, named, args[n_positional:]))
        attrs = {k: v for k, v in vars(c).items() if k not in _RESERVED}
        dyn_attrs = {k: v for k, v in attrs.items() if _has_traced(v)}
        if not all(_is_traced(v) or isinstance(v, tuple) and all(map(_is_traced, v))
                   for v in dyn_attrs.values()):
            raise TypeError("an attribute mixes arrays and values (an index (slice, array)): run eagerly")
        holder["static"] = {k: v for k, v in attrs.items() if k not in dyn_attrs}
        # a saved input is handed back as the input itself, not a compiled copy of it (memory);
        # a saved plain value (a Python number, None) stays what it was, not a 0-d float64 array
        holder["inputs"] = [next((j for j, d in enumerate(dyn) if d is a), None) for a in c._saved]
        holder["plain"] = [None if _is_traced(a) else (a,) for a in c._saved]
        saved = [None if j is not None or p is not None else a
                 for a, j, p in zip(c._saved, holder["inputs"], holder["plain"])]
        return out, saved, dyn_attrs

    op, baked = jax_cache.identity(cls), jax_cache.value_id(key[1:])
    ident = None if op is None or baked is None else ("forward", op, baked)
    return jax_cache.Program("forward", fwd, ident, aux=holder), holder


def _eager(cls, ctx, arrays, kwargs):
    """Run the forward as written (it reads a value back on the host, or takes a generator), and
    still let its backward compile: what it kept on ``ctx`` is split into arrays (arguments) and
    plain values (baked in) the way a compiled forward's is. Anything else keeps backward eager."""
    out = cls.forward(ctx, *arrays, **kwargs)
    attrs = {k: v for k, v in vars(ctx).items() if k not in _RESERVED}
    arrays_at = {k for k, v in attrs.items() if _is_array(v)}
    if all(k in arrays_at or _plain(v) for k, v in attrs.items()):
        ctx._jax_static = {k: v for k, v in attrs.items() if k not in arrays_at}
        ctx._jax_dyn = tuple(sorted(arrays_at))
    return out


_NO_KW: dict = {}
_SKEYS: dict = {}  # id(a compiled forward's static attributes) -> (them, their part of a backward key)


def _static_key(static: dict) -> tuple:
    """The backward key's text of a compiled forward's static attributes: each by ``repr``, computed
    once per forward entry (its dict is shared by every call), not once per backward."""
    hit = _SKEYS.get(id(static))
    if hit is None or hit[0] is not static:
        hit = _SKEYS[id(static)] = (static, tuple(sorted((k, repr(v)) for k, v in static.items())))
    return hit[1]


def _forward(cls, ctx, arrays, kwargs):
    """``cls.forward(ctx, *arrays, **kwargs)`` as one compiled call, looked up by ``_FORWARD``'s key.

    Every op on JAX comes through here, so the common case -- positional JAX arrays, no keywords --
    touches each argument once: its type, shape and dtype, no getattr probing, no sorting, and
    ``Program`` takes the arrays without flattening them."""
    jax_array = jax_cache.array_type()
    keys, dyn_at, ours, plain = [], [], False, True
    try:
        for i, a in enumerate(arrays):
            if type(a) is jax_array:  # (a shape is a tuple, a value's first item a name: never equal)
                keys.append((a.shape, a.dtype))
                dyn_at.append(i)
                ours = True
            else:
                k = _arg_key(a)
                keys.append(k)
                if type(k[0]) is tuple:  # another array: a tracer, NumPy's, CuPy's
                    dyn_at.append(i)
                    ours = ours or _is_jax(a)
    except TypeError:  # a random generator, or another value that is not plain: eager, if ours
        plain = False
    if not ours and not any(_is_jax(a) for a in arrays):
        return cls.forward(ctx, *arrays, **kwargs)  # CuPy arrays, scalars: not ours
    if not plain:
        return _eager(cls, ctx, arrays, kwargs)
    if kwargs:
        # an array passed by keyword (GetItem's integer index, or a tuple of them) is an argument
        # like the others, so the op compiles: eager JAX indexing is ~7 programs per new shape
        plain_kw, named, extra = _split_kwargs(kwargs)
        try:
            keys.extend(_arg_key(a) for a in extra)
            plain_key = tuple((k, _value_key(v)) for k, v in sorted(plain_kw.items()))
            if not _plain(list(plain_kw.values())):
                raise TypeError("not a plain value")
        except TypeError:
            return _eager(cls, ctx, arrays, kwargs)
        dyn_at.extend(i for i, a in enumerate(extra, len(arrays)) if _is_array(a))
        inputs = (*arrays, *extra)
    else:
        plain_kw, named, plain_key, inputs = _NO_KW, (), (), arrays
    key = (cls, tuple(keys), plain_key, named, ctx.needs_grad, ctx.record)
    try:
        entry = _FORWARD.get(key, False)
    except TypeError:  # an unhashable value (a list inside a tuple): eager
        return _eager(cls, ctx, arrays, kwargs)
    if entry is None:
        return _eager(cls, ctx, arrays, kwargs)
    dyn_args = inputs if len(dyn_at) == len(inputs) else [inputs[i] for i in dyn_at]
    if entry is False:
        with _lock_for(("make forward", key)):  # one jitted function per key, however many ranks
            entry = _FORWARD.get(key, False)
            if entry is None:
                return _eager(cls, ctx, arrays, kwargs)
            if entry is False:
                entry = _make_forward(cls, ctx, list(inputs), len(arrays), plain_kw, named, dyn_at, key)
                try:
                    result = entry[0](*dyn_args)
                except Exception:  # reads a value back on the host, writes in place, ...: eager
                    _FORWARD[key] = None  # (which raises again if the arguments are genuinely wrong)
                    return _eager(cls, ctx, arrays, kwargs)
                _FORWARD[key] = entry
            else:
                result = entry[0](*dyn_args)
    else:
        result = entry[0](*dyn_args)
    out, saved, dyn = result
    holder = entry[1]
    if ctx.record:  # (nothing is kept when no graph is built: no need to rebuild the list)
        ctx.save(*[dyn_args[j] if j is not None else p[0] if p is not None else a
                   for a, j, p in zip(saved, holder["inputs"], holder["plain"])])
    static = holder["static"]
    attrs = vars(ctx)
    attrs.update(static)
    if dyn:
        attrs.update(dyn)
    attrs["_jax_static"], attrs["_jax_dyn"], attrs["_jax_skey"] = static, tuple(dyn), _static_key(static)
    return out


_BACKWARD: dict = {}


def _backward(cls, ctx, grad):
    attrs = vars(ctx)
    static = attrs.get("_jax_static")
    if static is None:  # the forward ran eagerly
        return cls.backward(ctx, grad)
    names = attrs["_jax_dyn"]
    skey = attrs.get("_jax_skey")  # (a compiled forward's; an eager one's statics are new each call)
    if skey is None:
        skey = tuple(sorted((k, repr(v)) for k, v in static.items()))
    key = (cls, skey, names, ctx.needs_grad)
    fn = _BACKWARD.get(key)
    if fn is False:
        return cls.backward(ctx, grad)
    dyn = tuple([attrs[k] for k in names]) if names else ()
    saved = ctx.saved  # once: a saved-tensor hook may unpack (recompute, load from disk) on each read
    if fn is None:
        with _lock_for(("make backward", key)):
            fn = _BACKWARD.get(key)
            if fn is None:
                needs_grad = ctx.needs_grad

                def bwd(saved, dyn, g):
                    c = _TraceCtx(needs_grad)
                    c._saved = saved
                    vars(c).update(static)
                    vars(c).update(zip(names, dyn))
                    return cls.backward(c, g)  # a tuple, or one array for a one-input op

                op, baked = jax_cache.identity(cls), jax_cache.value_id(key[1:])
                ident = None if op is None or baked is None else ("backward", op, baked)
                fn = jax_cache.Program("backward", bwd, ident)
                try:
                    out = fn(saved, dyn, grad)
                except Exception:  # cannot be traced: eager from now on for this key
                    _BACKWARD[key] = False
                    return cls.backward(ctx, grad)
                _BACKWARD[key] = fn
                return out
        if fn is False:
            return cls.backward(ctx, grad)
    try:
        return fn(saved, dyn, grad)
    except Exception:  # this signature cannot be traced (a boolean mask index): eager, for it only
        return cls.backward(ctx, grad)


PURE_OPS = "minidist.autograd.ops"  # the package of the plain ops: each Function in it is pure array code


def _compilable(cls) -> bool:
    """Whether op ``cls`` may run as a compiled program: it is defined in the ``PURE_OPS`` package
    (any of its modules), or says it is pure array code with ``compilable = True``."""
    mod = cls.__module__
    return mod == PURE_OPS or mod.startswith(_PURE_OPS_DOT) or getattr(cls, "compilable", False)


_PURE_OPS_DOT = PURE_OPS + "."


def kernel(cls):
    """The compiled twin of op ``cls`` (a ``minidist.autograd.tensor.Function`` subclass). Only the pure
    array ops of the ``minidist.autograd.ops`` package are compiled, and Functions elsewhere that say
    they are pure with ``compilable = True`` (the fast forms of ``minidist.autograd.fused``, MoE's fused
    steps): a Function elsewhere -- a subclass of an op included -- may communicate (the tensor-
    parallel f and g of ``minidist.parallel.tensor.comm``) and must run eagerly, message by message."""
    if not _compilable(cls):
        return cls
    k = _KERNELS.get(cls)
    if k is None:
        k = _KERNELS[cls] = type(f"Jit{cls.__name__}", (cls,), {
            "forward": staticmethod(lambda ctx, *a, **kw: _forward(cls, ctx, a, kw)),
            "backward": staticmethod(lambda ctx, grad: _backward(cls, ctx, grad)),
        })
    return k


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


def pure(fn):
    """Decorator: on JAX arrays, run ``fn`` -- a pure function of arrays (in lists and tuples too)
    and plain values -- as one compiled call per signature, the plain values baked in; on anything
    else (NumPy, CuPy, the engine off), run it as written. For the array code outside the ops that
    would otherwise compile one program per primitive and shape (a bucket's views: a slice and a
    reshape per parameter, each a program of its own on eager JAX)."""
    import functools

    made: dict = {}

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if "jax" not in sys.modules:    # no JAX array can exist: the NumPy path pays one dict lookup
            return fn(*args, **kwargs)
        if not any(map(_holds_jax, (*args, *kwargs.values()))) or not enabled():
            return fn(*args, **kwargs)  # NumPy (JAX is not even imported), CuPy, the engine off
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

    return call


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

    if enabled():  # (``minidist.autograd.tensor`` the attribute is the tensor() function: take the module)
        sys.modules["minidist.autograd.tensor"].register_kernel_selector(kernel)


__all__ = ["STATS", "compilations", "compiles", "enabled", "fused", "install",
           "kernel", "pure", "zeros_like"]
