"""Each op as one compiled JAX program, forward and backward: ``kernel(cls)``.

``kernel(cls)`` returns a subclass of the op whose ``forward`` runs ``cls.forward`` under ``jax.jit``
with a stand-in context (``_TraceCtx``), returning the output, what it saved for backward, and the
array attributes it set; plain attributes (shapes, axes) are remembered from the trace. Its
``backward`` runs ``cls.backward`` the same way. Keys: the op, each argument's shape and dtype
(non-arrays by value; an array passed by keyword, like an index, is an argument too), the keyword
arguments, which inputs want gradients. An op that cannot be traced (a host random generator, a
value read back with ``int()``) runs eagerly, decided once per key; its backward still compiles.
Which ops compile at all: every Function of the ``PURE_OPS`` package, and any that says
``compilable = True``.
"""

from __future__ import annotations

import threading

from minidist.accel import jax_cache
from minidist.accel.jax_values import (
    _arg_key,
    _has_traced,
    _is_array,
    _is_jax,
    _is_traced,
    _join_kwargs,
    _plain,
    _split_kwargs,
    _value_key,
)

_FORWARD: dict = {}   # key -> (jitted forward, static attributes holder) or None (runs eagerly)
_KERNELS: dict = {}   # op class -> its jitted subclass
_RESERVED = ("needs_grad", "record", "_saved", "_unpack")

# Every compiled unit below is a ``jax_cache.Program``: compiled once per argument signature (the
# first call holds a lock, so rank threads meeting a new shape at once compile it once: JAX does not
# merge concurrent compilations), and loaded from minidist's executable cache when a run before
# compiled it -- no trace, no lowering.
_LOCKS: dict = {}
_LOCKS_LOCK = threading.Lock()


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
    """The compiled form of op ``cls`` (a ``minidist.autograd.tensor.Function`` subclass). Only the pure
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
