"""Array backends: the few operations that differ between NumPy, CuPy and JAX.

Everything in minidist computes with ``be.xp`` (the array namespace: ``numpy``, ``cupy`` or
``jax.numpy``) and calls a Backend method only where the libraries genuinely disagree:

* ``scatter_add``   -- NumPy/CuPy add into an array in place, JAX returns a new array;
* ``to_host`` / ``from_host`` -- moving arrays to and from NumPy (communication, checkpoints);
* ``rng``           -- seeded random numbers; drawn on the host with NumPy so the same seed gives
                       the same numbers on every backend (parallel == serial across libraries);
* ``synchronize``   -- wait for queued device work (timing on GPUs and with JAX's async dispatch);
* ``inplace`` and ``update`` -- optimizers write state in place where the library allows it.

Select one by name: ``get_backend("jax")``, or the ``MINIDIST_BACKEND`` environment variable
(default ``numpy``). Dtypes are always explicit: JAX is switched to 64-bit mode so that
``float64`` means float64 everywhere and nothing is silently downcast.
"""

from __future__ import annotations

import os
import threading

import numpy as np

from minidist.accel import compiled, jax_engine
from minidist.accel.segment_add import cupy_scatter_add

BACKENDS = ("numpy", "cupy", "jax")


class Backend:
    """NumPy: the reference backend. Subclasses override only what differs."""

    name = "numpy"
    inplace = True  # arrays can be updated in place (optimizers use this to avoid temporaries)

    def __init__(self, device=None):
        self.xp = np
        self.device = device
        tune_allocator()

    # -- moving data -------------------------------------------------------------------------
    def asarray(self, x, dtype=None):
        return np.asarray(x, dtype=dtype)

    def to_host(self, x) -> np.ndarray:
        """A NumPy view or copy of ``x`` (zero-copy where the library allows)."""
        return np.asarray(x)

    def from_host(self, x: np.ndarray):
        return x

    def is_array(self, x) -> bool:
        return isinstance(x, np.ndarray)

    # -- the operations that differ --------------------------------------------------------
    def scatter_add(self, target, indices, values):
        """``target[indices] += values`` with repeated indices accumulated; returns the result."""
        np.add.at(target, indices, values)
        return target

    def update(self, target, value):
        """Write ``value`` into ``target`` (in place where possible); returns the array to keep."""
        target[...] = value
        return target

    def set_at(self, target, index, values):
        """``target[index] = values`` (in place where possible); returns the array to keep."""
        target[index] = values
        return target

    def synchronize(self):
        pass

    def rng(self, seed) -> np.random.Generator:
        """A seeded host generator; draw with it, then ``from_host`` the result."""
        return np.random.default_rng(seed)

    def random_normal(self, rng: np.random.Generator, shape, dtype, scale=1.0):
        return self.from_host((rng.standard_normal(shape) * scale).astype(dtype))

    def __repr__(self):
        return f"<Backend {self.name}{'' if self.device is None else f' on {self.device}'}>"


class CupyBackend(Backend):
    name = "cupy"

    def __init__(self, device=None):
        try:
            import cupy
        except ImportError as e:  # pragma: no cover - needs a GPU machine
            raise RuntimeError("backend 'cupy' needs CuPy: pip install 'minidist[cupy]'") from e
        self.xp = cupy
        self.device = device
        if device is not None:
            cupy.cuda.Device(device).use()

    def asarray(self, x, dtype=None):
        return self.xp.asarray(x, dtype=dtype)

    def to_host(self, x):
        return self.xp.asnumpy(x)

    def from_host(self, x):
        return self.xp.asarray(x)

    def is_array(self, x):
        return isinstance(x, self.xp.ndarray)

    def scatter_add(self, target, indices, values):
        """In place, in NumPy's order of additions (not cupyx's atomics, whose order varies run to
        run): repeated ids, an embedding's gradient, give the same bits every run (segment_add.py)."""
        return cupy_scatter_add(target, indices, values)

    def synchronize(self):
        self.xp.cuda.get_current_stream().synchronize()


def configure_jax():
    """Import JAX and set what every minidist JAX computation assumes; returns the module. float64
    stays float64, and float32 stays float32: by default a GPU multiplies float32 matrices in TF32
    (10-bit mantissa) and a TPU in bfloat16 passes, so a parallel run and its serial twin that
    agree on a CPU would differ on a GPU (chapter 16 has the measurement). The backend, the compiled
    SPMD program and the TPU lesson all start here."""
    try:
        import jax
    except ImportError as e:
        raise RuntimeError("backend 'jax' needs JAX: pip install 'minidist[jax]'") from e
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_default_matmul_precision", "highest")
    return jax


class JaxBackend(Backend):
    name = "jax"
    inplace = False

    def __init__(self, device=None):
        jax = configure_jax()
        import jax.numpy as jnp

        jax_engine.install()  # each op's forward/backward compiled once per shape (MINIDIST_JAX_JIT=0: off)
        jax_engine.persistent_cache()  # compiled programs kept on disk: a rerun does not compile again
        self.jax = jax
        self.xp = jnp
        self.device = device

    def asarray(self, x, dtype=None):
        return self.from_host(np.asarray(x, dtype=dtype)) if not self.is_array(x) else x.astype(
            dtype or x.dtype)

    def to_host(self, x):
        return np.asarray(x)

    def from_host(self, x):
        """A copy of ``x`` on this backend's device (on the default device, uncommitted, if none).
        ``jax.device_put``, not ``jnp.asarray``: that one compiles a small program per shape."""
        x = np.asarray(x)
        return self.jax.device_put(x, self.device) if self.device is not None else self.jax.device_put(x)

    def is_array(self, x):
        return isinstance(x, self.jax.Array)

    def scatter_add(self, target, indices, values):
        return _jax_scatter_add(target, indices, values)

    def update(self, target, value):
        if self.is_array(value):
            return value if value.dtype == target.dtype else value.astype(target.dtype)
        return jax_engine.put_like(np.asarray(value, dtype=target.dtype), target)  # no compiled program

    def set_at(self, target, index, values):
        return _jax_set_at(target, index, values)

    def synchronize(self):
        """Wait for the work queued on this backend's device: a tiny computation queued after it
        (a device runs its programs in order) is waited for. ``effects_barrier`` alone waits only
        for side effects, so GPU step times read low."""
        self.jax.effects_barrier()
        self.jax.block_until_ready(self.from_host(np.zeros((), np.float32)) + 1)


# One compiled program per shape, the index an argument (eager JAX's ``.at[].add`` compiles 3-5
# programs for each new shape: an MoE lesson's routing makes new shapes every step).
@compiled.pure
def _jax_scatter_add(target, indices, values):
    return target.at[indices].add(values)


@compiled.pure
def _jax_set_at(target, index, values):
    return target.at[index].set(values)


_tuned = False


def tune_allocator() -> None:
    """Keep freed memory in the process instead of returning it to the OS at once (glibc only).

    A training step allocates and frees the same large temporaries every time. By default glibc
    serves every block above a (sliding) threshold with a fresh mmap and unmaps it
    on free, so every step pays page faults again. Raising the mmap threshold and
    the trim threshold lets the step reuse its memory. Set ``MINIDIST_TUNE_MALLOC=0`` to skip.
    """
    global _tuned
    if _tuned or os.environ.get("MINIDIST_TUNE_MALLOC", "1") == "0":
        return
    _tuned = True
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
        libc.mallopt(m_mmap_threshold, 32 * 2**20)
        libc.mallopt(m_trim_threshold, 2**30)
        libc.mallopt(m_top_pad, 256 * 2**20)
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


_CLASSES = {"numpy": Backend, "cupy": CupyBackend, "jax": JaxBackend}
_cache: dict = {}
_lock = threading.Lock()
_local = threading.local()


def get_backend(name: str | Backend | None = None, device=None) -> Backend:
    """The Backend called ``name`` (default: ``$MINIDIST_BACKEND`` or ``numpy``).

    ``device`` binds it to one device: a JAX device object, or a CuPy GPU index.
    """
    if isinstance(name, Backend):
        return name
    if name is None:
        name = os.environ.get("MINIDIST_BACKEND", "numpy")
    name = name.lower()
    if name not in _CLASSES:
        raise ValueError(f"unknown backend {name!r}; known backends: {', '.join(BACKENDS)}")
    key = (name, None if device is None else str(device))
    with _lock:
        if key not in _cache:
            _cache[key] = _CLASSES[name](device)
        return _cache[key]


def set_default_backend(name: str | Backend | None) -> None:
    """Make ``name`` the default backend for this thread (each threads-transport rank has its own)."""
    _local.backend = None if name is None else get_backend(name)


def default_backend() -> Backend:
    be = getattr(_local, "backend", None)
    return be if be is not None else get_backend()


_BY_TYPE: dict = {}


def compiles_per_shape(backend) -> bool:
    """Does ``backend``'s array library compile a program per array shape (JAX)? Then shapes that
    change every step are bucketed (KV cache reads, MoE's routed rows, balanced shares: see
    ``minidist/infer/buckets.py``); NumPy and CuPy keep their exact shapes (and their speed)."""
    return getattr(backend, "name", None) == "jax"


def bucket(n: int, cap: int) -> int:
    """The smallest power of two >= ``n``, at most ``cap`` (the cache's length): 1, 2, 4, 8, ..."""
    if n < 1:
        raise ValueError(f"bucket: need a length >= 1, got {n}")
    return min(1 << (int(n) - 1).bit_length(), max(int(cap), int(n)))


def to_host(array) -> np.ndarray:
    """Any backend's array as a NumPy array (a copy from a GPU; NumPy's own as is). For checks and
    prints: CuPy refuses ``np.asarray`` of a device array, so code that may see one calls this."""
    return backend_of(array).to_host(array)


def host_scalar(value, like):
    """``value`` as a NumPy scalar of ``like``'s dtype (float64 for a Python number): what NumPy
    makes of ``value`` combined with ``like``. Handed to a compiled JAX call it is an argument, not
    a constant: a new divisor or token count runs the same program instead of compiling another."""
    return np.dtype(getattr(like, "dtype", np.float64)).type(value)


def backend_of(array) -> Backend:
    """The backend whose arrays ``array`` is (NumPy for anything that isn't CuPy or JAX).

    Called for every op: the answer is cached per array type (a dict lookup, no lock)."""
    kind = type(array)
    be = _BY_TYPE.get(kind)
    if be is None:
        mod = kind.__module__
        name = "jax" if mod.startswith(("jax", "jaxlib")) else "cupy" if mod.startswith("cupy") else "numpy"
        be = _BY_TYPE[kind] = get_backend(name)
    return be
