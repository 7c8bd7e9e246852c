"""The JAX engine: every op's forward and backward as one compiled function, cached by shape and dtype.

Eager JAX dispatches each ``jnp`` call on its own (tens of microseconds each, and every call is a
small XLA program). minidist's ops are already written as whole functions -- ``Gelu.forward`` is one
chain, ``LayerNorm.backward`` one formula, ``scaled_dot_product_attention`` and ``cross_entropy``
fused -- so here each one is traced once with ``jax.jit`` and then runs as **one** compiled call.

How: ``kernel(cls)`` returns a subclass of the op whose ``forward`` runs ``cls.forward`` under
``jax.jit`` with a stand-in context, returning the output, what it saved for backward, and the
array attributes it set; plain attributes (shapes, axes) are remembered from the trace. Its
``backward`` runs ``cls.backward`` the same way on what was saved. Keys: the op, each argument's
shape and dtype (non-arrays by value), the keyword arguments, which inputs want gradients. An op
that cannot be traced (a host random generator, a value read back with ``int()``) runs eagerly,
decided once per key. ``tensor.Function.apply`` asks ``kernel`` only for non-NumPy arrays.

``MINIDIST_JAX_JIT=0`` turns it off (eager dispatch, the reference).
"""

from __future__ import annotations

import os

import numpy as np

_FORWARD: dict = {}   # key -> (jitted forward, static attributes holder) or None (runs eagerly)
_KERNELS: dict = {}   # op class -> its jitted subclass
_RESERVED = ("needs_grad", "record", "_saved", "_unpack")


def enabled() -> bool:
    return os.environ.get("MINIDIST_JAX_JIT", "1") not in ("0", "false", "False", "")


class _TraceCtx:
    """The context an op sees while it is traced: saves and attributes, nothing else."""

    def __init__(self, needs_grad, record=True):
        self.needs_grad, self.record, self._saved = needs_grad, record, ()

    def save(self, *arrays):
        self._saved = arrays

    @property
    def saved(self):
        return self._saved


def _is_traced(v) -> bool:
    import jax

    return isinstance(v, (jax.Array, jax.core.Tracer))


_PLAIN = (type(None), bool, int, float, str, slice, type(Ellipsis), np.dtype, np.generic)


def _plain(v) -> bool:
    """A value the compiled op may bake in: numbers, strings, slices, tuples of them. Anything
    else (a random generator: its draws would be frozen at trace time) keeps the op eager."""
    if isinstance(v, (tuple, list)):
        return all(_plain(x) for x in v)
    return isinstance(v, _PLAIN)


def _arg_key(a):
    if hasattr(a, "shape") and hasattr(a, "dtype"):
        return ("a", tuple(a.shape), str(a.dtype))
    if not _plain(a):
        raise TypeError("not a plain value")
    return ("v", a)


def _forward(cls, ctx, arrays, kwargs):
    import jax

    if not any(type(a).__module__.startswith(("jax", "jaxlib")) for a in arrays):
        return cls.forward(ctx, *arrays, **kwargs)  # CuPy arrays, scalars: not ours
    try:
        key = (cls, tuple(_arg_key(a) for a in arrays), tuple(sorted(kwargs.items())), ctx.needs_grad,
               ctx.record)
        if not _plain(list(kwargs.values())):
            raise TypeError("not a plain value")
        hash(key)
    except TypeError:  # a random generator, or another value that is not plain: eager
        return cls.forward(ctx, *arrays, **kwargs)
    entry = _FORWARD.get(key, False)
    if entry is None:
        return cls.forward(ctx, *arrays, **kwargs)
    dyn_at = [i for i, a in enumerate(arrays) if hasattr(a, "shape") and hasattr(a, "dtype")]
    if entry is False:
        holder: dict = {}

        fixed = [None if i in dyn_at else a for i, a in enumerate(arrays)]  # no array kept alive

        def fwd(*dyn):
            args = list(fixed)
            for i, d in zip(dyn_at, dyn):
                args[i] = d
            c = _TraceCtx(ctx.needs_grad, ctx.record)
            out = cls.forward(c, *args, **kwargs)
            attrs = {k: v for k, v in vars(c).items() if k not in _RESERVED}
            holder["static"] = {k: v for k, v in attrs.items() if not _is_traced(v)}
            # a saved input is handed back as the input itself, not a compiled copy of it (memory)
            holder["inputs"] = [next((j for j, d in enumerate(dyn) if d is a), None) for a in c._saved]
            saved = [None if j is not None else a for a, j in zip(c._saved, holder["inputs"])]
            return out, saved, {k: v for k, v in attrs.items() if _is_traced(v)}

        entry = (jax.jit(fwd), holder)
        try:
            result = entry[0](*[arrays[i] for i in dyn_at])
        except Exception:  # reads a value back on the host, writes in place, ...: eager (which
            _FORWARD[key] = None  # raises again if the arguments are genuinely wrong)
            return cls.forward(ctx, *arrays, **kwargs)
        _FORWARD[key] = entry
    else:
        result = entry[0](*[arrays[i] for i in dyn_at])
    out, saved, dyn = result
    given = [arrays[i] for i in dyn_at]
    saved = [a if j is None else given[j] for a, j in zip(saved, entry[1]["inputs"])]
    if ctx.record:
        ctx.save(*saved)
    vars(ctx).update(entry[1]["static"])
    vars(ctx).update(dyn)
    ctx._jax_static = entry[1]["static"]
    ctx._jax_dyn = tuple(dyn)
    return out


_BACKWARD: dict = {}


def _backward(cls, ctx, grad):
    import jax

    static = getattr(ctx, "_jax_static", None)
    if static is None:  # the forward ran eagerly
        return cls.backward(ctx, grad)
    names = ctx._jax_dyn
    key = (cls, tuple(sorted((k, repr(v)) for k, v in static.items())), names, ctx.needs_grad)
    fn = _BACKWARD.get(key)
    if fn is None:
        def bwd(saved, dyn, g):
            c = _TraceCtx(ctx.needs_grad)
            c._saved = saved
            vars(c).update(static)
            vars(c).update(zip(names, dyn))
            return cls.backward(c, g)  # a tuple, or one array for a one-input op

        fn = jax.jit(bwd)
        try:
            out = fn(ctx.saved, tuple(getattr(ctx, k) for k in names), grad)
        except Exception:  # cannot be traced: eager from now on for this key
            _BACKWARD[key] = False
            return cls.backward(ctx, grad)
        _BACKWARD[key] = fn
        return out
    if fn is False:
        return cls.backward(ctx, grad)
    return fn(ctx.saved, tuple(getattr(ctx, k) for k in names), grad)


def kernel(cls):
    """The compiled twin of op ``cls`` (a ``minidist.tensor.Function`` subclass). Only the pure
    array ops of ``minidist.ops`` are compiled: a Function elsewhere may communicate (the tensor-
    parallel f and g of ``minidist.parallel.tp_comm``) and must run eagerly, message by message."""
    if cls.__module__ != "minidist.ops":
        return cls
    k = _KERNELS.get(cls)
    if k is None:
        k = _KERNELS[cls] = type(f"Jit{cls.__name__}", (cls,), {
            "forward": staticmethod(lambda ctx, *a, **kw: _forward(cls, ctx, a, kw)),
            "backward": staticmethod(lambda ctx, grad: _backward(cls, ctx, grad)),
        })
    return k


def persistent_cache() -> None:
    """Keep every compiled program in JAX's persistent compilation cache (``MINIDIST_JAX_CACHE``,
    default ~/.cache/minidist/jax; ``0`` turns it off; a ``JAX_COMPILATION_CACHE_DIR`` of your own
    wins). A lesson's time on JAX is mostly compilation, once per op shape and device: measured
    here, the tensor-parallel lesson took 28 s the first time and 8 s the next."""
    import jax

    default = os.path.join(os.path.expanduser("~"), ".cache", "minidist", "jax")
    path = os.environ.get("MINIDIST_JAX_CACHE", default)
    if path in ("0", "") or os.environ.get("JAX_COMPILATION_CACHE_DIR") or \
            jax.config.jax_compilation_cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def install() -> None:
    """Route ops on JAX arrays through ``kernel`` (``tensor.Function.apply``'s hook)."""
    import sys

    if enabled():  # (``minidist.tensor`` the attribute is the tensor() function: take the module)
        sys.modules["minidist.tensor"].JIT_KERNEL = kernel


__all__ = ["enabled", "install", "kernel", "np"]
