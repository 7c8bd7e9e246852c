"""The compilation seam: how an array engine (JAX's, ``jax_engine``) reaches minidist's algorithms.

Algorithms mark the array code an engine may compile and run it as written until one registers:

* ``@pure``: a pure function of arrays and plain values (a bucket's views, one ring-attention step);
* ``fused(name, formula, columns, scalars)``: one parameter's update formula over every parameter
  (an optimizer step);
* ``kernel(cls)``: the class that runs an autograd op (``Function.apply`` asks).

The JAX backend registers its engine when it starts (``register``); NumPy and CuPy never see one,
and pay one global lookup per call.
"""

from __future__ import annotations

import functools

ENGINE = None  # the registered engine (minidist.accel.jax_engine), or None: everything as written


def register(engine) -> None:
    """Route marked code through ``engine``: its ``pure_call``, ``fused``, ``compiles``, ``kernel``,
    ``zeros_like`` (None: everything as written again)."""
    global ENGINE
    ENGINE = engine


def pure(fn):
    """Decorator: ``fn`` as one compiled call per signature where the engine compiles its arrays."""
    made: dict = {}  # the engine's programs for fn, by signature

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if ENGINE is None:
            return fn(*args, **kwargs)
        return ENGINE.pure_call(fn, made, args, kwargs)

    return call


def compiles(array) -> bool:
    """Does an update of ``array`` run through the engine's ``fused``?"""
    return ENGINE is not None and ENGINE.compiles(array)


def fused(name: str, formula, columns: list, scalars: tuple, donate: tuple = ()) -> list:
    """``[formula(*row, *scalars) for row in zip(*columns)]``, as one compiled call on the engine."""
    if compiles(columns[0][0]):
        return ENGINE.fused(name, formula, columns, scalars, donate)
    return [formula(*row, *scalars) for row in zip(*columns)]


def kernel(cls):
    """The class that runs autograd op ``cls`` on non-NumPy arrays: the engine's compiled form, or ``cls``."""
    return cls if ENGINE is None else ENGINE.kernel(cls)


def zeros_like(a):
    """Zeros shaped like ``a``, made where the engine keeps ``a`` (no compiled program)."""
    return ENGINE.zeros_like(a)
