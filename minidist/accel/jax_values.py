"""What a compiled JAX call may bake in, and how its arguments become a cache key.

An op's or a pure function's arguments are arrays (traced: arguments of the program, keyed by shape
and dtype) or plain values (numbers, strings, slices, dtypes: baked into the program, keyed by type
and value). Anything else -- a random generator, whose draws would freeze at trace time -- keeps
the call eager. Keyword arguments holding arrays (an index) become inputs too (``_split_kwargs``).
"""

from __future__ import annotations

import numpy as np

from minidist.accel import jax_cache


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
