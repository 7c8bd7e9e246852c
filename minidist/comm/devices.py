"""Bind each rank to a device of its backend: JAX device ``rank % n``, CuPy GPU ``rank % n``.

With JAX on a CPU the devices are forced with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``
(set before JAX is imported); on a TPU VM each core is a device, one rank each.
"""

from __future__ import annotations

from minidist.backend import Backend, get_backend


def bind_backend(backend, rank: int) -> Backend:
    """The Backend rank ``rank`` computes with (NumPy has no device; JAX/CuPy get ``rank % n``)."""
    if isinstance(backend, Backend):
        return backend
    name = get_backend(backend).name  # validates the name, applies MINIDIST_BACKEND
    if name == "jax":
        import jax

        devices = jax.devices()
        return get_backend("jax", device=devices[rank % len(devices)])
    if name == "cupy":
        import cupy

        gpu = rank % cupy.cuda.runtime.getDeviceCount()
        cupy.cuda.Device(gpu).use()  # current device is per thread: set it in this rank's thread
        return get_backend("cupy", device=gpu)
    return get_backend(name)
