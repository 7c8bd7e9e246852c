"""Compiling a program fresh, so that its executable can be stored: not one loaded from JAX's cache.

``_compile_fresh(lowered)`` compiles under settings of JAX's for this thread only and tells whether
XLA really compiled it (only those executables serialize with their machine code); see below.
"""

from __future__ import annotations

import sys
import threading
import warnings

from minidist.accel.jax_identity import _SOURCES_LOCK

# An executable that JAX loaded from its own persistent cache serializes WITHOUT its machine code
# (measured, jax 0.10.2 on CPU: the file loads, and running it fails with "Function
# broadcast_add_fusion not found"). So our programs are compiled under a JAX cache key of their own
# (the module's source locations included) that JAX never writes (minimum compile time infinite),
# both set for this thread only -- JAX's cache keeps serving the eager programs outside minidist's
# units. A hit on JAX's cache that happens anyway is seen (its event, in this thread) and the
# program is used but not stored.
_HITS = threading.local()
_LISTENING: list = []


_WARN_LOCK = threading.Lock()
_WARNED: set = set()


def _warn_once(text: str) -> None:
    with _WARN_LOCK:
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
